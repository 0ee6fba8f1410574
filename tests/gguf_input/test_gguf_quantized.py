"""A quantized GGUF on the quantized path (its blocks held as in the file, widened
inside the matmul: model/cpu/quant_weights.py) against the same file on the exact
path (--dtype float32, dequantized at load): per-step logits of a prompt's prefill (a
wide step) and of teacher-forced decode steps (one row, the C layer loop) agree to
what the order of fp32 sums allows, and greedy tokens are the same.

The bound: the kernel widens each weight to exactly the exact path's fp32 value
(tests/worker/test_quant_linear.py checks it bit for bit) and keeps activations fp32,
so the two paths differ only in the order of each dot product's sums: at most
n * 2^-24 of sum|x w| per matmul (n <= 256 here: 1.5e-5), compounded over two layers
and the norms. 1e-4 of the largest logit holds that with room and is ten times below
the gap between a tiny random model's top two logits on these prompts."""

from __future__ import annotations

import pytest
import torch

from gguf import GGMLQuantizationType as T
from tests.gguf_input.test_gguf_models import _gguf
from tests.worker.test_model_matches_transformers import (_chunk_logits, _prompt,
                                                          _relative_error, _state)
from worker_svc.config import WorkerConfig
from worker_svc.model.cpu import quant_weights
from worker_svc.model.cpu.quant_weights import QuantWeight
from worker_svc.runner import ModelRunner

pytestmark = pytest.mark.skipif(quant_weights.load() is None, reason="no C compiler")
BOUND = 1e-4
DECODE_STEPS = 12


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GAPSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _runner(path, **config) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), device="cpu", max_model_len=256,
                                    num_gpu_blocks_override=64, max_num_seqs=8, **config))


def _teacher_forced(runner, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The prefill's logits, then each decode step's, feeding `tokens` one at a time."""
    state = _state(prompt)
    out = [_chunk_logits(runner, state, len(prompt))]
    for t in tokens:
        state.token_ids.append(t)
        out.append(_chunk_logits(runner, state, 1))
    return out


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K,
                                  T.Q6_K, T.Q2_K], ids=lambda k: k.name)
def test_quantized_path_agrees_with_the_exact_path_step_by_step(tmp_path, kind):
    path = _gguf(tmp_path, "llama", kind)
    exact, quant = _runner(path, dtype="float32"), _runner(path)
    assert "weights=" not in exact.compute_plan.summary()
    assert f"weights=gguf_quantized:{kind.name}" in quant.compute_plan.summary()
    assert isinstance(quant.model.w.layers[0].qkv, QuantWeight)
    assert quant.compute_plan.layer_loop == "c_loop"  # decode steps: the C layer loop
    prompt = [t % 261 for t in _prompt(0, 40)]
    # the exact path's greedy continuation, step by step; then fed to the quantized one
    state = _state(prompt)
    steps, tokens = [_chunk_logits(exact, state, len(prompt))], []
    for _ in range(DECODE_STEPS):
        tokens.append(int(steps[-1][-1].argmax()))
        state.token_ids.append(tokens[-1])
        steps.append(_chunk_logits(exact, state, 1))
    got = _teacher_forced(quant, prompt, tokens)
    for i, (g, w) in enumerate(zip(got, steps)):
        assert _relative_error(g, w) < BOUND, f"step {i}"
        assert torch.equal(g.argmax(-1), w.argmax(-1)), f"step {i}: greedy token differs"
