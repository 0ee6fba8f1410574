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
from tests.gguf_input.test_gguf_models import _FAMILIES, _gguf
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


def _exact_greedy(exact, prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """The exact path's logits of the prompt and of each of its DECODE_STEPS greedy
    steps, and the tokens it chose."""
    state = _state(prompt)
    steps, tokens = [_chunk_logits(exact, state, len(prompt))], []
    for _ in range(DECODE_STEPS):
        tokens.append(int(steps[-1][-1].argmax()))
        state.token_ids.append(tokens[-1])
        steps.append(_chunk_logits(exact, state, 1))
    return steps, tokens


def _agree_step_by_step(quant, exact) -> None:
    """The exact path's greedy continuation, step by step, fed to the quantized one:
    every step's logits within BOUND and the same greedy token."""
    prompt = [t % 261 for t in _prompt(0, 40)]
    steps, tokens = _exact_greedy(exact, prompt)
    got = _teacher_forced(quant, prompt, tokens)
    for i, (g, w) in enumerate(zip(got, steps)):
        assert _relative_error(g, w) < BOUND, f"step {i}"
        assert torch.equal(g.argmax(-1), w.argmax(-1)), f"step {i}: greedy token differs"


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K,
                                  T.Q6_K, T.Q2_K], ids=lambda k: k.name)
def test_quantized_path_agrees_with_the_exact_path_step_by_step(tmp_path, kind):
    path = _gguf(tmp_path, "llama", kind)
    exact, quant = _runner(path, dtype="float32"), _runner(path)
    assert "weights=" not in exact.compute_plan.summary()
    assert f"weights=gguf_quantized:{kind.name}" in quant.compute_plan.summary()
    assert isinstance(quant.model.w.layers[0].qkv, QuantWeight)
    assert quant.compute_plan.layer_loop == "c_loop"  # decode steps: the C layer loop
    _agree_step_by_step(quant, exact)


# one type each (the kernel's types are all covered above): the families' own parts
# are what is checked here - Gemma's scaled embedding, 1 + w norms and tied head,
# Qwen3's q/k norms, Phi-3's fused qkv/gate_up rows, Qwen3-MoE's per-expert weights.
# A router's near-tie flips an expert as a logits' near-tie flips a greedy token: the
# Q8_0 tiny Qwen3-MoE has one (top-2 probabilities 2e-7 apart on this prompt), Q5_1's
# closest is 5e-4, far above what the order of sums moves.
@pytest.mark.parametrize("arch,kind", [("gemma3", T.Q4_K), ("gemma2", T.Q8_0),
                                       ("qwen3", T.Q5_0), ("phi3", T.Q4_1),
                                       ("qwen3moe", T.Q5_1)],
                         ids=["gemma3-Q4_K", "gemma2-Q8_0", "qwen3-Q5_0", "phi3-Q4_1",
                              "qwen3moe-Q5_1"])
def test_torch_layer_families_take_the_quantized_path_and_agree_with_the_exact_one(
        tmp_path, arch, kind):
    path = _gguf(tmp_path, arch, kind)
    exact, quant = _runner(path, dtype="float32"), _runner(path)
    assert f"weights=gguf_quantized:{kind.name}" in quant.compute_plan.summary()
    assert not quant.compute_plan.c_layers  # the torch layers call the kernel
    w = quant.model.w
    assert isinstance(w.embed, QuantWeight) and isinstance(w.layers[0].qkv, QuantWeight)
    assert isinstance(w.layers[0].o_proj, QuantWeight)
    mlp = w.layers[0].mlp
    assert all(isinstance(t, QuantWeight) for t in
               ([mlp.gate_up[0], mlp.down[0]] if arch == "qwen3moe" else [mlp.gate_up, mlp.down]))
    assert quant.weight_bytes < exact.weight_bytes / 2  # held as blocks, not fp32
    # Gemma 3's decode steps run its own C layer loop (with the window: tiny configs
    # slide over 16 keys), the others their torch layers
    assert quant.compute_plan.layer_loop == ("c_loop" if arch == "gemma3" else "torch")
    _agree_step_by_step(quant, exact)


def test_gemma3_c_layer_loop_serves_sliding_and_global_layers_past_the_window(
        tmp_path, monkeypatch):
    """Six layers, as llama.cpp's gemma3 lays them out (five sliding, then a global
    one; the GGUF holds only the window), decoded past the 16-key window: every decode
    step runs the C loop (each layer its RoPE base and window) and agrees with the
    exact path's torch layers; a step with a prefill runs the torch layers."""
    monkeypatch.setitem(_FAMILIES, "gemma3", (*_FAMILIES["gemma3"][:2], dict(
        _FAMILIES["gemma3"][2], num_hidden_layers=6)))
    path = _gguf(tmp_path, "gemma3", T.Q8_0)
    exact, quant = _runner(path, dtype="float32"), _runner(path)
    assert quant.model.windows == [16] * 5 + [None]
    calls = []
    run = quant.model.decode_layers.run
    monkeypatch.setattr(quant.model.decode_layers, "run",
                        lambda x, *a: calls.append(x.shape[0]) or run(x, *a))
    _agree_step_by_step(quant, exact)
    assert calls == [1] * DECODE_STEPS


def test_gemma2_keeps_its_torch_layers_on_the_quantized_path(tmp_path):
    """Gemma 2 caps its attention scores, which the C loop does not: torch layers."""
    quant = _runner(_gguf(tmp_path, "gemma2", T.Q8_0))
    assert quant.compute_plan.weights == "gguf_quantized"
    assert quant.compute_plan.layer_loop == "torch" and quant.model.decode_layers is None


# --quant-activations int8: x rounded to 8 bits a block in every matmul, as llama.cpp's
# are. Not the exact path's logits: within INT8_BOUND of them (the tiny models' logits
# move ~1% a step; a wrong row, block or scale moves them by their own size). The
# kernel's own arithmetic is held bit for bit in tests/worker/test_quant_packed.py.
INT8_BOUND = 0.1


# (Not Q6_K here: the tiny Q6_K model's blocks are random bits, int8 scales across the
# whole range, and its prefill's row 6 moves 0.9 of its logits under int8 x although
# every matmul equals int8 x times the dequantized weight to 1e-4 (checked call by
# call): an amplification of 8-bit rounding, not a wrong sum. Q6_K's kernel is held
# bit for bit in tests/worker/test_quant_packed.py.)
@pytest.mark.parametrize("arch,kind", [("llama", T.Q8_0), ("llama", T.Q4_K),
                                       ("gemma3", T.Q5_0), ("qwen3", T.Q4_1)],
                         ids=["llama-Q8_0", "llama-Q4_K", "gemma3-Q5_0", "qwen3-Q4_1"])
def test_int8_activations_serve_every_loop_close_to_the_exact_path(tmp_path, arch, kind):
    path = _gguf(tmp_path, arch, kind)
    exact, quant = _runner(path, dtype="float32"), _runner(path, quant_activations="int8")
    assert "quant_activations=int8" in quant.compute_plan.summary()
    w = quant.model.w
    assert all(p is not None for p in w.layers[0].qkv.packed)  # repacked at load
    assert w.lm_head is w.embed or not w.embed.packed  # a lookup-only table is not
    prompt = [t % 261 for t in _prompt(1, 40)]
    steps, tokens = _exact_greedy(exact, prompt)
    errors = [_relative_error(g, want) for g, want in
              zip(_teacher_forced(quant, prompt, tokens), steps)]
    assert max(errors) < INT8_BOUND, errors
    assert min(errors) > 0  # the int8 path ran: not the exact kernel's sums
