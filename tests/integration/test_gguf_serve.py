"""`gapserve serve --model file.gguf` end to end: the real services on loopback serve a
GGUF's greedy tokens equal to transformers' own `gguf_file=` load of the same file: a
tiny Q4_0 llama here, and (e2e) Gemma 3 270M Q4_K_M from its PyPI chunk packages
against the token ids tests/data/make_gemma3_reference.py wrote."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from gguf import GGMLQuantizationType as T
from tests.gguf_input.gguf_files import write_gguf
from tests.gguf_input.test_gguf_models import _hf, _tiny
from tests.integration.serve_process import start_serve

REFERENCE = Path(__file__).parents[1] / "data" / "gemma3_270m_reference.json"


def _served(serve, prompt_ids: list[int], max_tokens: int) -> tuple[int, str]:
    """Greedy completion of a token-id prompt: how many tokens (logprobs lists one
    entry per token) and their text."""
    url = f"http://127.0.0.1:{serve.ports['--http-port']}/v1/completions"
    models = httpx.get(url.replace("completions", "models"), timeout=60).json()
    body = {"model": models["data"][0]["id"], "prompt": prompt_ids, "temperature": 0,
            "max_tokens": max_tokens, "logprobs": 1, "ignore_eos": True,
            "skip_special_tokens": False}
    reply = httpx.post(url, json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return len(choice["logprobs"]["tokens"]), choice["text"]


def test_served_tiny_gguf_greedy_tokens_equal_transformers_gguf_load(tmp_path):
    path = tmp_path / "m" / "tiny-llama-q4_0.gguf"
    path.parent.mkdir()
    write_gguf(_tiny("llama"), path, "llama", T.Q4_0)
    prompt = [1, 40, 77, 120, 3, 9, 200, 55]
    with torch.no_grad():
        want = _hf(path).generate(torch.tensor([prompt]), max_new_tokens=12,
                                  do_sample=False, eos_token_id=None,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    want_ids = want[0, len(prompt):].tolist()
    # --dtype float32: the exact path (the default for a Q4_0 file is the quantized one)
    serve = start_serve(path, tmp_path / "serve.log", "--dtype", "float32")
    try:
        serve.wait_ready()
        assert _served(serve, prompt, 12) == (len(want_ids), tok.decode(want_ids))
    finally:
        serve.stop()


@pytest.mark.e2e
def test_gemma3_270m_gguf_served_greedy_equals_transformers_reference(tmp_path):
    from shared.model_files.gemma3_270m import ensure_gemma3_270m
    reference = json.loads(REFERENCE.read_text())
    # Gemma 3 270M's KV cache (18 layers, 1 KV head of 256) needs more than the tiny 8 MiB.
    # No --dtype: the quantized path (the file's blocks; docs/formats.md), whose fp32
    # sums differ from the reference's only in order: these 4 x 24 tokens stay equal
    serve = start_serve(ensure_gemma3_270m(), tmp_path / "serve.log",
                        "--kv-cache-memory", str(64 << 20))
    try:
        serve.wait_ready()
        for case in reference["cases"]:
            got = _served(serve, case["prompt_ids"], len(case["completion_ids"]))
            assert got == (len(case["completion_ids"]), case["completion_text"]), case["prompt"]
    finally:
        serve.stop()
