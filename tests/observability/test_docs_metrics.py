"""docs/observability.md lists every metric the services register, and nothing
else, and every `gapserve.*` span attribute: an operator reads that page to know
what exists. The names are read from the source (string constants of the exact form
`gapserve:name` / `vllm:name` / `gapserve.a.b`, so no docstring or comment counts),
not from an imported registry, so the workers' modules need not load torch here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "observability.md"
PACKAGES = ("frontend_svc", "scheduler_svc", "worker_svc", "shared", "gapserve")
NAME = re.compile(r"(gapserve|vllm):[a-z0-9_]+")
ATTRIBUTE = re.compile(r"gapserve(\.[a-z0-9_]+)+")
NAMING_CALLS = {"get_tracer", "get_logger", "getLogger"}  # their "gapserve.x" is no attribute


def _constants(root: Path) -> list[tuple[str, str, bool]]:
    """(string constant, its file, whether it names a tracer or logger) in the source."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "proto" in path.relative_to(root).parts:
                continue  # generated code
            tree = ast.parse(path.read_text(), str(path))
            naming = {id(a) for call in ast.walk(tree) if isinstance(call, ast.Call)
                      and getattr(call.func, "id", getattr(call.func, "attr", None))
                      in NAMING_CALLS for a in call.args}
            out += [(n.value, str(path.relative_to(root)), id(n) in naming)
                    for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return out


def code_metric_names(root: Path = ROOT) -> dict[str, str]:
    """{metric name: the file that names it} over the services' source."""
    found = {}
    for value, path, _ in _constants(root):
        if NAME.fullmatch(value):
            found.setdefault(value, path)
    return found


def code_span_attributes(root: Path = ROOT) -> dict[str, str]:
    """{`gapserve.*` span attribute: the file that sets it}."""
    constants = _constants(root)
    names = {value for value, _, naming in constants if naming}
    found = {}
    for value, path, _ in constants:
        if ATTRIBUTE.fullmatch(value) and value not in names:
            found.setdefault(value, path)
    return found


def documented(name: str, text: str) -> bool:
    """A row names it in backticks, as exported: a counter gains `_total`; the
    vLLM table names its series without the `vllm:` prefix."""
    prefix, _, bare = name.partition(":")
    spellings = {name, f"{name}_total"}
    if prefix == "vllm":
        spellings |= {bare, f"{bare}_total"}
    return any(re.search(rf"`{re.escape(s)}(?:[`{{])", text) for s in spellings)


def test_the_scan_finds_the_metrics_of_every_service():
    names = code_metric_names()
    # one known name per service and per kind of definition: the scan is not empty
    for name in ("gapserve:num_requests_running", "gapserve:time_to_first_token_seconds",
                 "gapserve:model_forward_time_milliseconds", "gapserve:requests_routed",
                 "gapserve:structured_output_compile_seconds", "vllm:num_requests_waiting",
                 "vllm:time_to_first_token_seconds"):
        assert name in names, name


def test_every_metric_in_the_code_has_a_row_in_the_doc():
    text = DOC.read_text()
    missing = {n: f for n, f in code_metric_names().items() if not documented(n, text)}
    assert not missing, f"metrics without a row in docs/observability.md: {missing}"


def test_every_gapserve_metric_the_doc_names_exists():
    names = set(code_metric_names())
    text = DOC.read_text()
    stale = {m for m in re.findall(r"`(gapserve:[a-z0-9_]+)", text)
             if m not in names and m.removesuffix("_total") not in names}
    assert not stale, f"docs/observability.md names metrics the code lacks: {stale}"


def attribute_documented(name: str, text: str) -> bool:
    """In full, or as the doc's tables abbreviate a family: `.last_part`."""
    last = name.rsplit(".", 1)[1]
    return f"`{name}`" in text or f"`.{last}`" in text


def test_every_span_attribute_in_the_code_is_in_the_doc():
    attributes = code_span_attributes()
    assert {"gapserve.step.id", "gapserve.replica", "gapserve.request.tool_choice"} <= set(
        attributes)
    text = DOC.read_text()
    missing = {a: f for a, f in attributes.items() if not attribute_documented(a, text)}
    assert not missing, f"span attributes not in docs/observability.md: {missing}"


def test_a_new_metric_without_a_row_is_caught(tmp_path):
    pkg = tmp_path / "frontend_svc"
    pkg.mkdir()
    (pkg / "new.py").write_text('X = Counter("gapserve:brand_new_thing", "doc")\n'
                                '"""not `gapserve:in_a_docstring`"""\n')
    names = code_metric_names(tmp_path)
    assert names == {"gapserve:brand_new_thing": "frontend_svc/new.py"}
    assert not documented("gapserve:brand_new_thing", DOC.read_text())
    assert documented("gapserve:brand_new_thing", "| `gapserve:brand_new_thing_total` |")


def test_a_new_span_attribute_is_caught_and_a_tracer_name_is_not(tmp_path):
    pkg = tmp_path / "scheduler_svc"
    pkg.mkdir()
    (pkg / "new.py").write_text('_tracer = get_tracer("gapserve.scheduler")\n'
                                'span.set_attribute("gapserve.step.brand_new", 1)\n')
    assert code_span_attributes(tmp_path) == {"gapserve.step.brand_new": "scheduler_svc/new.py"}
    assert not attribute_documented("gapserve.step.brand_new", DOC.read_text())
