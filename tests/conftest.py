"""Fixtures every test folder may use."""

import pytest


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
