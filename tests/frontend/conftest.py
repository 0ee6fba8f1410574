import pytest

from frontend_svc.request.tokenizer import TextTokenizer


@pytest.fixture(scope="session")
def tokenizer() -> TextTokenizer:
    """The default model's real tokenizer (byte-level BPE with a chat template)."""
    from shared.model_files.default_model import ensure_default_model
    return TextTokenizer.from_dir(ensure_default_model())
