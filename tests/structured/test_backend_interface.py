"""Structured outputs sit behind one backend interface (shared/structured/backend.py),
and what the wire types carry depends on no grammar engine."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

from shared.structured import compile_cache
from shared.structured.backend import GrammarBackend, GrammarMatcher
from shared.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher

ROOT = Path(__file__).resolve().parents[2]


def test_the_wire_types_load_no_grammar_engine_metrics_or_threads():
    code = ("import sys, shared.types, shared.wire.common\n"
            "print(sorted(m for m in ('llguidance', 'prometheus_client', 'torch', "
            "'shared.structured.compile_cache') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_spec_module_imports_only_the_standard_library():
    tree = ast.parse((ROOT / "shared/structured/spec.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "dataclasses"}, imported


def _methods(protocol: type) -> set[str]:
    return {name for name, value in vars(protocol).items()
            if callable(value) and not name.startswith("_")}


def test_the_llguidance_backend_implements_the_whole_interface():
    for protocol, impl in ((GrammarMatcher, LLGuidanceMatcher),
                           (GrammarBackend, LLGuidanceBackend)):
        assert _methods(protocol) <= set(dir(impl)), _methods(protocol) - set(dir(impl))
        for name in _methods(protocol):  # the same parameters, so callers can swap backends
            assert list(inspect.signature(getattr(protocol, name)).parameters) == \
                list(inspect.signature(getattr(impl, name)).parameters), name
    assert isinstance(compile_cache.BACKEND, LLGuidanceBackend)
    assert compile_cache.CACHE.backend is compile_cache.BACKEND
