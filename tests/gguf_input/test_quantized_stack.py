"""The default model's own Q4_1 GGUF served on the quantized path by real services:
the worker holds the file's blocks (the compute plan says weights=gguf_quantized),
/v1/models reports it, and greedy chat output is coherent."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import start_stack
from worker_svc.model.cpu import quant_weights

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(quant_weights.load() is None, reason="no C compiler")]


@pytest.fixture(scope="module")
def quantized_stack(tmp_path_factory):
    from shared.model_files.default_model import ensure_default_model
    stack = start_stack(ensure_default_model(), tmp_path_factory.mktemp("quantized-stack"),
                        flags=["--max-model-len", "1024", "--kv-cache-memory", str(64 << 20)])
    yield stack
    stack.stop()


def test_models_reports_the_quantized_path(quantized_stack):
    entry = httpx.get(quantized_stack.http_url + "/v1/models").json()["data"][0]
    assert entry["quantization"] == "gguf"
    assert entry["weights"] == "gguf_quantized:Q4_1+Q8_0"
    # what OpenAI's client reads of it still reads
    model = quantized_stack.openai().models.list().data[0]
    assert model.id == quantized_stack.served_model_name


def test_greedy_chat_on_the_quantized_path_is_coherent(quantized_stack):
    client = quantized_stack.openai(timeout=300)
    reply = client.chat.completions.create(
        model=quantized_stack.served_model_name, temperature=0.0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert "gguf_quantized_weights" in quantized_stack.logs(200_000)
