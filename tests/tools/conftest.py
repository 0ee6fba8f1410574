from tests.frontend.conftest import tokenizer  # noqa: F401  (the default model's tokenizer)
