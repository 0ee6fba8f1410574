"""Fixtures every test folder may use, and the order the suite runs in."""

from pathlib import Path

import pytest

# Folders whose files start real stacks and take tens of seconds each, longest first:
# run on two xdist workers (scripts/test.sh), the long files go out first and the
# many short ones fill in behind them, so no worker ends on a long file while the
# other sits idle. Collection order otherwise; a test's outcome never depends on it.
FIRST = ("integration", "deploy", "bench", "gguf_input", "spec", "structured",
         "observability", "families", "kernels")


def pytest_collection_modifyitems(items):
    root = Path(__file__).parent

    def rank(item) -> int:
        parts = Path(str(item.fspath)).relative_to(root).parts
        return FIRST.index(parts[0]) if len(parts) > 1 and parts[0] in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the files keep their order within a folder


@pytest.fixture(scope="session")
def hf_model_cache():
    """transformers' float32 reference model of a checkpoint directory (or of the GGUF a
    view directory serves), loaded once per directory."""
    from tests.integration.hf_reference import load_reference
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = load_reference(path)
        return cache[path]
    return get
