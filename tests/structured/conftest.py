"""The integration fixtures (real services on loopback), shared with tests/integration."""

from tests.integration.conftest import (  # noqa: F401 (pytest finds fixtures by name)
    default_stack, start_stack_factory, tiny_model_dir, tiny_stack)
