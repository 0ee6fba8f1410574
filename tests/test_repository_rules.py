"""Rules of the repository as a whole (issue 29): GAPSERVE_ variables are read in
shared/config.py only, and nothing tracked points at a file outside the checkout."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "shared/config.py"


def tracked(*patterns: str) -> list[str]:
    """Tracked paths (relative to ROOT) that exist in the working tree."""
    out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [p for p in out.split("\0") if p and (ROOT / p).is_file()]


# ---------------------------------------------------------------------------
# GAPSERVE_ variables: one reader, shared/config.py

VARIABLE = re.compile(r"GAPSERVE_[A-Z0-9_]+")


def _names_a_variable(node: ast.AST, aliases: set[str]) -> bool:
    """Whether an expression spells a GAPSERVE_ variable's name: a literal, an f-string
    or a concatenation that starts with GAPSERVE_, config's ENV_PREFIX or env_name(),
    or a module-level name bound to one of those."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith("GAPSERVE_")
    if isinstance(node, ast.JoinedStr):
        return bool(node.values) and _names_a_variable(node.values[0], aliases)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _names_a_variable(node.left, aliases)
    if isinstance(node, ast.Name):
        return node.id in aliases or node.id == "ENV_PREFIX"
    if isinstance(node, ast.Attribute):
        return node.attr == "ENV_PREFIX" or node.attr.endswith("_ENV") and \
            node.attr.isupper()
    if isinstance(node, ast.Call):
        fn = node.func
        return (fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")) \
            == "env_name"
    return False


def _is_environ(node: ast.AST) -> bool:
    """os.environ, environ, self.environ, ... (a mapping of the environment)."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("environ", "environb")


def environment_reads(source: str) -> list[str]:
    """Each read of a GAPSERVE_ variable in `source`, and each literal that is exactly a
    variable's name (a name spelled outside shared/config.py is read somewhere)."""
    tree = ast.parse(source)
    aliases = {t.id for node in tree.body if isinstance(node, ast.Assign)
               and _names_a_variable(node.value, set())
               for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr in ("get", "pop", "setdefault") \
                    and _is_environ(fn.value) or \
                    isinstance(fn, ast.Attribute) and fn.attr in ("getenv", "getenvb") or \
                    isinstance(fn, ast.Name) and fn.id == "getenv":
                key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn))
                                                   for o in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None and _names_a_variable(key, aliases):
            found.append(f"line {node.lineno}: reads {ast.unparse(key)}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and VARIABLE.fullmatch(node.value):
            found.append(f"line {node.lineno}: names {node.value}")
    return found


@pytest.mark.parametrize("source", [
    'import os\nx = os.environ.get("GAPSERVE_CACHE_DIR")',
    'import os\nx = os.getenv(f"GAPSERVE_{name}")',
    'import os\nx = os.environ[flags.ENV_PREFIX + "THREADS"]',
    'import os\nx = "GAPSERVE_" + "X" in os.environ',
    'import os\nENV = flags.DEFAULT_MODEL_WHEEL_ENV\nx = os.environ.get(ENV)',
    'import os\nx = os.environ.get(flags.env_name("--cpu-threads"), "")',
    'WHEEL = "GAPSERVE_DEFAULT_MODEL_WHEEL"',
])
def test_the_check_finds_a_read_however_the_name_is_spelled(source):
    assert environment_reads(source), source


def test_the_check_leaves_other_variables_and_writes_alone():
    assert environment_reads(
        'import os\nx = os.environ.get("OMP_NUM_THREADS")\n'
        'env = {flags.ENV_PREFIX + "X": "1"}\n'
        'env[flags.env_name("--seed")] = "3"\n'
        '"""set GAPSERVE_CACHE_DIR=... to move the cache"""') == []


def test_no_module_reads_a_gapserve_variable_from_the_environment():
    """Every flag's variable is read by shared/config.py's parse_args; the few
    variables without a flag (the default model's cache and wheel, the fault hook, the
    compile timeout) by its accessors. Other modules ask config, so one file says
    which variables exist."""
    modules = [p for p in tracked("*.py") if not p.startswith("tests/") and p != CONFIG]
    assert {p.split("/")[0] for p in modules} >= {
        "frontend_svc", "scheduler_svc", "worker_svc", "shared", "gapserve", "benchmarks"}
    offenders = [f"{path}: {what}" for path in modules
                 for what in environment_reads((ROOT / path).read_text())]
    assert offenders == [], "read these through shared/config.py:\n" + "\n".join(offenders)


# ---------------------------------------------------------------------------
# a self-contained repository

# The team's reference files live outside this checkout (next to it, in shared/docs);
# our own documents are lower-case under docs/ (docs/scheduling.md, docs/architecture.md).
OUTSIDE = re.compile("|".join([
    r"\.\./shared/docs", r"\bshared/docs/",
    *(rf"\b{name}\.md\b" for name in ("SCHEDULING", "ARCHITECTURE", "ECOSYSTEM", "STYLE")),
]))
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()


def outside_references(text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            for m in OUTSIDE.finditer(text)]


def test_the_reference_check_finds_each_form():
    text = "see ../shared/docs/x\nSCHEDULING.md says\n(ARCHITECTURE.md)\nSTYLE.md, ECOSYSTEM.md"
    assert [r.split(": ")[1] for r in outside_references(text)] == [
        "../shared/docs", "SCHEDULING.md", "ARCHITECTURE.md", "STYLE.md", "ECOSYSTEM.md"]
    assert outside_references("docs/scheduling.md and docs/architecture.md") == []


def test_no_tracked_file_points_outside_the_repository():
    offenders = []
    for path in tracked():
        if path == THIS_FILE:
            continue
        data = (ROOT / path).read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        offenders += [f"{path} {ref}" for ref in
                      outside_references(data.decode("utf-8", "replace"))]
    assert offenders == [], "the repository must stand alone:\n" + "\n".join(offenders)


MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def test_relative_links_in_the_docs_stay_inside_and_land_on_a_file():
    broken = []
    for path in tracked("*.md"):
        for target in MD_LINK.findall((ROOT / path).read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            where = (ROOT / path).parent / target
            if not where.resolve().is_relative_to(ROOT) or not where.exists():
                broken.append(f"{path}: {target}")
    assert broken == []


# ---------------------------------------------------------------------------
# one direction of dependencies: services import shared and themselves, shared none

SERVICES = ("frontend_svc", "scheduler_svc", "worker_svc", "gapserve")


def imported_packages(source: str) -> set[str]:
    """The top-level packages a module imports, at any depth (imports inside
    functions count: a lazy import is still a dependency)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_the_import_check_sees_lazy_and_dotted_imports():
    assert imported_packages(
        "import shared.config\n"
        "def f():\n    from worker_svc.model import llama\n"
        "from . import sibling\n") == {"shared", "worker_svc"}


@pytest.mark.parametrize("package", ("shared", *SERVICES))
def test_services_import_shared_and_themselves_and_shared_imports_no_service(package):
    allowed = {package} if package == "shared" else {package, "shared"}
    offenders = [f"{path}: imports {', '.join(sorted(bad))}"
                 for path in tracked(f"{package}/*.py")
                 if (bad := (imported_packages((ROOT / path).read_text())
                             & {"shared", *SERVICES}) - allowed)]
    assert offenders == [], "\n".join(offenders)


# ---------------------------------------------------------------------------
# no re-exports for compatibility (issue 39): a name is imported from where it lives


def _reexports(source: str) -> list[str]:
    """Names a module passes on without defining: listed in its __all__ though only
    imported, or imported under a comment that says it is re-exported."""
    tree = ast.parse(source)
    imported = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                for t in node.targets):
            found += [f"__all__ lists imported {e.value}" for e in node.value.elts
                      if isinstance(e, ast.Constant) and e.value in imported]
    lines = source.splitlines()
    found += [f"line {n.lineno}: {lines[n.lineno - 1].strip()}" for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom))
              and "re-export" in lines[n.lineno - 1]]
    return found


def test_the_reexport_check_finds_both_spellings():
    assert _reexports("from a import b\n__all__ = ['b']")
    assert _reexports("from a import b  # noqa: F401 (re-exported)")
    assert not _reexports("def b(): pass\n__all__ = ['b']")


def test_no_module_re_exports_what_it_imports():
    """A package's __init__.py may name its API; any other module defines what it
    exports, so a reader finds each name where its import says."""
    offenders = [f"{path}: {what}" for path in tracked("*.py")
                 if not path.endswith("__init__.py")
                 for what in _reexports((ROOT / path).read_text())]
    assert offenders == [], "import these from where they are defined:\n" + \
        "\n".join(offenders)
