"""Latency summaries of a simulation, as a readable table or as JSON."""

from __future__ import annotations

import math

from scheduler_svc.sim.runner import SimResult


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(settings: dict, result: SimResult) -> dict:
    groups = {}
    for name, times in result.groups.items():
        ttft, itl = times.ttft_ms, times.itl_ms
        groups[name] = {
            "ttft_ms": {"mean": sum(ttft) / len(ttft) if ttft else math.nan,
                        "p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99),
                       "max": max(itl) if itl else math.nan},
        }
    return {"settings": settings, "preemptions": result.preemptions,
            "recomputed_tokens": result.recomputed_tokens,
            "makespan_ms": round(result.makespan_ms, 3), "steps": result.num_steps,
            "groups": groups}


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def table(rows: list[dict]) -> str:
    """One line per setting and group; the run-wide columns repeat on each group's line."""
    head = ["settings", "group", "ttft mean", "ttft p50", "ttft p99", "itl p50", "itl p99",
            "itl max", "preempt", "recomputed", "makespan"]
    lines = []
    for row in rows:
        setting = " ".join(f"{k}={v}" for k, v in row["settings"].items()) or "(defaults)"
        for name, g in row["groups"].items():
            t, i = g["ttft_ms"], g["itl_ms"]
            lines.append([setting, name, _ms(t["mean"]), _ms(t["p50"]), _ms(t["p99"]),
                          _ms(i["p50"]), _ms(i["p99"]), _ms(i["max"]), str(row["preemptions"]),
                          str(row["recomputed_tokens"]), _ms(row["makespan_ms"])])
    widths = [max(len(h), *(len(line[c]) for line in lines)) for c, h in enumerate(head)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths)))
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines]
    return "\n".join(out) + "\n(times in ms)"


def json_safe(obj):
    """NaN is not JSON: an empty statistic becomes null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj
