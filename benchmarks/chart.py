"""The README's chart: gapserve against vLLM and llama.cpp, drawn from a recorded
side_by_side report (docs/results/side_by_side-*.json) into docs/img/.

    python benchmarks/chart.py                      # the newest report -> docs/img/side_by_side.svg
    python benchmarks/chart.py --report docs/results/side_by_side-2026-12-02-zen3-g.json

Hand-written SVG, so drawing needs nothing beyond the standard library (no plotting
package in any environment). Four panels: throughput at the report's concurrency
and for a single stream (higher is better), a single stream's time to first token
and time per output token (lower is better); each bar is the median over the
repeats with a whisker from min to max, the figures side_by_side.py's table shows.
Run it again after every new side_by_side run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from html import escape
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "img" / "side_by_side.svg"

# the servers drawn, in order, with their labels; others in a report are left out
LABELS = {
    "gapserve": "gapserve fp32",
    "gapserve-steps8": "gapserve fp32, steps 8",
    "vllm": "vLLM CPU fp32",
    "llamacpp": "llama.cpp f32",
    "gapserve-int8": "gapserve int8",
    "gapserve-int8-steps8": "gapserve int8, steps 8",
    "llamacpp-q8_0": "llama.cpp Q8_0",
}
COLORS = {"gapserve": "#2b6cb0", "vllm": "#dd6b20", "llamacpp": "#2f855a"}


def _family(server: str) -> str:
    return next(f for f in COLORS if server.startswith(f))


def _single_ttft_ms(run: dict) -> float:
    return run["single"]["ttft_ms"]["mean"]


def _single_tpot_ms(run: dict) -> float:
    figure = run["single"].get("tpot_ms") or run["single"]["itl_ms"]
    return figure["mean"]


def panels(report: dict) -> list[tuple[str, bool, dict[str, tuple[float, float, float]]]]:
    """(title, higher is better, {server: (median, min, max)}) per panel."""
    servers = [s for s in LABELS if s in report["servers"]]
    runs = {s: report["servers"][s]["runs"] for s in servers}
    concurrency = runs[servers[0]][0]["concurrent"]["concurrency"]
    figures = [
        (f"{concurrency} concurrent streams: output tok/s", True,
         lambda r: r["concurrent"]["output_throughput"]),
        ("one stream: output tok/s", True, lambda r: r["single"]["output_throughput"]),
        ("one stream: time to first token, ms", False, _single_ttft_ms),
        ("one stream: time per output token, ms", False, _single_tpot_ms),
    ]
    out = []
    for title, higher, fig in figures:
        values = {}
        for s in servers:
            xs = [fig(r) for r in runs[s]]
            values[s] = (statistics.median(xs), min(xs), max(xs))
        out.append((title, higher, values))
    return out


def svg(report: dict) -> str:
    """The whole chart as one SVG document."""
    drawn = panels(report)
    n = len(next(iter(drawn))[2])
    label_w, bar_w, row_h, head_h, gap = 150, 210, 20, 38, 24
    panel_w, panel_h = label_w + bar_w + 60, head_h + n * row_h + 8
    width, title_h = 2 * panel_w + gap, 54
    height = title_h + 2 * panel_h + gap + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" '
             f'font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="8" y="20" font-size="15" font-weight="bold">SmolLM2-135M-Instruct on '
             f'{escape(report.get("machine", "?"))}: gapserve, vLLM, llama.cpp</text>',
             f'<text x="8" y="40" fill="#555">{escape(_subtitle(report))}</text>']
    for i, (title, higher, values) in enumerate(drawn):
        x0 = (i % 2) * (panel_w + gap)
        y0 = title_h + (i // 2) * (panel_h + gap)
        top = max(hi for _, _, hi in values.values()) or 1.0
        better = "higher is better" if higher else "lower is better"
        parts.append(f'<text x="{x0 + 8}" y="{y0 + 16}" font-weight="bold">{escape(title)}'
                     f'</text><text x="{x0 + 8}" y="{y0 + 31}" fill="#777" font-size="11">'
                     f'{better}; median of the repeats, whisker min-max</text>')
        for j, (server, (med, lo, hi)) in enumerate(values.items()):
            y = y0 + head_h + j * row_h
            w, wl, wh = (bar_w * v / top for v in (med, lo, hi))
            bx = x0 + label_w
            parts += [
                f'<text x="{bx - 6}" y="{y + 13}" text-anchor="end">'
                f'{escape(LABELS[server])}</text>',
                f'<rect x="{bx}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" '
                f'fill="{COLORS[_family(server)]}"/>',
                f'<line x1="{bx + wl:.1f}" x2="{bx + wh:.1f}" y1="{y + row_h / 2}" '
                f'y2="{y + row_h / 2}" stroke="#222" stroke-width="1.2"/>',
                f'<text x="{bx + max(w, wh) + 5:.1f}" y="{y + 13}">{med:,.0f}</text>',
            ]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _subtitle(report: dict) -> str:
    first = next(iter(report["servers"].values()))["runs"][0]["concurrent"]
    return (f"recorded {report.get('date', '?')}, {report.get('repeats', '?')} alternated "
            f"repeats, {first['num_requests']} chat requests x {first['max_tokens']} tokens, "
            "greedy (benchmarks/side_by_side.py)")


def newest_report(results: Path = RESULTS) -> Path:
    """The side_by_side report with the latest recorded date (names sort by day only)
    among those the chart is about: gapserve beside both vLLM and llama-server (the
    same-GGUF reports against llama-server alone have their own tables in
    docs/benchmarks.md)."""
    def full(path: Path) -> bool:
        servers = json.loads(path.read_text()).get("servers", {})
        return "gapserve" in servers and "vllm" in servers and "llamacpp" in servers
    reports = [p for p in sorted(results.glob("side_by_side-*.json")) if full(p)]
    if not reports:
        raise FileNotFoundError(f"no side_by_side-*.json with gapserve, vllm and llamacpp "
                                f"in {results}")
    return max(reports, key=lambda p: (json.loads(p.read_text()).get("date", ""), p.name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=None,
                        help="a side_by_side JSON report (default: the newest in docs/results)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    report_path = args.report or newest_report()
    report = json.loads(report_path.read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg(report))
    print(f"{args.out} from {report_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
