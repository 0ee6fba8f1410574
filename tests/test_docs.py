"""The documents say what the code does (issue 44 item 5): the README opens with the
chart, the two commands and a five-line quickstart; the chart is what
benchmarks/chart.py draws from the newest recorded report; the README's `gapserve
sim` commands reproduce the tables under them; the docs index lists every document;
`gapserve status --help` prints its whole description."""

from __future__ import annotations

import json
import re
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gapserve import status
from gapserve.cli import main as gapserve_main
from scheduler_svc.sim.cli import main as sim_main
from tests.bench.test_serve_bench import _load

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
chart = _load("chart")


def _top() -> str:
    """The README before its first section about the system itself."""
    return README.split("## What it is", 1)[0]


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def test_the_readme_opens_with_the_chart_then_the_two_commands_then_the_quickstart():
    top = _top()
    image = re.search(r"!\[[^\]]+\]\((docs/img/[^)]+)\)", top)
    assert image, "no chart image before '## What it is'"
    assert (ROOT / image.group(1)).is_file()
    order = [top.index(image.group(0)), top.index("## The two commands"),
             top.index("## Quickstart")]
    assert order == sorted(order)
    commands = top.split("## The two commands", 1)[1].split("## Quickstart", 1)[0]
    assert "scripts/serve.sh" in commands and "scripts/test.sh" in commands


def test_the_quickstart_is_five_lines_that_serve_ask_and_diagnose():
    quick = _top().split("## Quickstart", 1)[1]
    block = _code_blocks(quick)[0]
    lines = block.strip().splitlines()
    assert len(lines) <= 5
    assert "scripts/serve.sh" in block and "/v1/chat/completions" in block
    assert "gapserve status" in block


def test_the_flag_table_lives_in_docs_flags_md_and_the_readme_links_it():
    # no table row of flags in the README (whatever the page's layout: hand-moved or
    # generated from the declarations by shared/flags_doc.py)
    assert not re.search(r"^\| `--", README, flags=re.M)
    flags_doc = (ROOT / "docs" / "flags.md").read_text()
    for flag in ("--max-num-seqs", "--max-model-len", "--kv-cache-memory"):
        assert flag in flags_doc
    for linked in ("docs/flags.md", "docs/tuning.md", "docs/README.md"):
        assert f"]({linked})" in README


def test_the_docs_index_lists_every_document():
    index = (ROOT / "docs" / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        if doc.name != "README.md":
            assert f"]({doc.name})" in index, f"docs/README.md does not list {doc.name}"


def test_the_chart_draws_every_recorded_server_as_valid_svg():
    report = json.loads(chart.newest_report().read_text())
    drawn = chart.svg(report)
    ET.fromstring(drawn)  # well-formed
    for server in report["servers"]:
        if server in chart.LABELS:
            assert f">{chart.LABELS[server]}<" in drawn


def test_the_committed_chart_is_the_one_drawn_from_the_newest_report():
    report = json.loads(chart.newest_report().read_text())
    assert (ROOT / "docs" / "img" / "side_by_side.svg").read_text() == chart.svg(report), \
        "stale chart: run python benchmarks/chart.py"


def test_the_chart_script_writes_where_it_is_told(tmp_path):
    out = tmp_path / "chart.svg"
    assert chart.main(["--out", str(out)]) == 0
    assert out.read_text().startswith("<svg")


# columns of the README's simulator tables -> the figure of a `gapserve sim --json` row
SIM_COLUMNS = {
    "budget": lambda r: r["settings"]["max-num-batched-tokens"],
    "threshold": lambda r: r["settings"]["long-prefill-token-threshold"],
    "chat TTFT p99": lambda r: r["groups"]["chat"]["ttft_ms"]["p99"],
    "chat ITL max": lambda r: r["groups"]["chat"]["itl_ms"]["max"],
    "long prompt TTFT": lambda r: r["groups"]["long"]["ttft_ms"]["mean"],
    "max-num-seqs": lambda r: r["settings"]["max-num-seqs"],
    "preemptions": lambda r: r["preemptions"],
    "tokens recomputed": lambda r: r["recomputed_tokens"],
    "ITL max (ms)": lambda r: r["groups"]["grow"]["itl_ms"]["max"],
    "TTFT mean (ms)": lambda r: r["groups"]["grow"]["ttft_ms"]["mean"],
    "makespan (ms)": lambda r: r["makespan_ms"],
}


def _sim_examples() -> list[tuple[list[str], list[str], list[list[str]]]]:
    """(argv, header, rows) for each `gapserve sim` block followed by a table."""
    section = README.split("## Capacity planning", 1)[1].split("\n## ", 1)[0]
    out = []
    for match in re.finditer(r"```sh\n(gapserve sim .*?)```\n\n((?:\|[^\n]*\n)+)", section, re.S):
        argv = shlex.split(match.group(1).replace("\\\n", " "))[2:]
        table = [[c.strip() for c in line.strip("|").split("|")]
                 for line in match.group(2).strip().splitlines()]
        out.append((argv, table[0], table[2:]))
    return out


def test_the_readme_has_a_command_for_each_simulator_table():
    assert len(_sim_examples()) == 2


@pytest.mark.parametrize("example", range(2))
def test_each_readme_sim_command_reproduces_the_table_under_it(example, capsys, monkeypatch):
    argv, header, rows = _sim_examples()[example]
    monkeypatch.chdir(ROOT)  # the commands name scenarios/ from the checkout's root
    assert sim_main([*argv, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    computed = [[f"{SIM_COLUMNS[col](r):,.0f}" for col in header] for r in results]
    assert sorted(rows) == sorted(computed)


def test_status_help_prints_the_whole_description(capsys):
    with pytest.raises(SystemExit) as stop:
        gapserve_main(["status", "--help"])
    assert stop.value.code == 0
    shown = capsys.readouterr().out
    for line in status.__doc__.strip().splitlines():
        assert line in shown, f"gapserve status --help lost {line!r}"
