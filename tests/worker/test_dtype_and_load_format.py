"""bfloat16 on CPU (bf16 matmul weights, fp32 activations and KV cache), the dummy
load format (random weights of the checkpoint's real shapes) and zero-cost steps."""

import shutil

import pytest
import torch

from worker_svc.config import WorkerConfig
from worker_svc.model.cpu import cpu_dtype
from worker_svc.runner import ModelRunner
from worker_svc.zero_cost import made_up_token

from .step_driver import StepDriver


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), device="cpu", max_model_len=256,
                                    num_gpu_blocks_override=64, max_num_seqs=8, **kw))


def _shapes(runner: ModelRunner) -> dict[str, tuple]:
    w = runner.model.w
    out = {"embed": tuple(w.embed.shape), "lm_head": tuple(w.lm_head.shape),
           "final_norm": tuple(w.final_norm.shape), "tied": w.lm_head is w.embed}
    for i, lw in enumerate(w.layers):
        for name in lw.__slots__:
            t = getattr(lw, name)
            out[f"{i}.{name}"] = None if t is None else tuple(t.shape)
    return out


@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_dummy_load_format_builds_the_real_shapes_from_config_alone(checkpoint, request,
                                                                     tmp_path):
    real = request.getfixturevalue(checkpoint)
    for f in real.iterdir():  # everything but the weights
        if not f.name.endswith(".safetensors") and f.is_file():
            shutil.copy(f, tmp_path / f.name)
    dummy = _runner(tmp_path, load_format="dummy")
    assert _shapes(dummy) == _shapes(_runner(real))
    w = dummy.model.w.layers[0].qkv
    w = w.to_dense() if w.is_mkldnn else w  # prepacked (cpu_dtype)
    assert float(w.abs().max()) <= 1e-3 and float(w.std()) > 0  # random, small


def test_dummy_weights_still_run_a_step_with_finite_logits(tiny_llama_dir):
    driver = StepDriver(_runner(tiny_llama_dir, load_format="dummy"))
    driver.add("a", list(range(3, 20)), max_new=3)
    driver.run_to_completion()
    assert len(driver.requests["a"].output) == 3


def test_zero_cost_steps_refuse_real_weights():
    with pytest.raises(ValueError, match="load_format dummy"):
        WorkerConfig(zero_cost_steps=True).validate()
    with pytest.raises(ValueError, match="load_format must be"):
        WorkerConfig(load_format="pt").validate()


def test_zero_cost_steps_answer_once_the_prompt_is_in_and_allocate_no_kv(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, load_format="dummy", zero_cost_steps=True)
    assert runner.kv_caches == [] and runner.num_kv_blocks == 64
    driver = StepDriver(runner)
    req = driver.add("a", list(range(3, 40)), max_new=4)
    first = driver.step({"a": 20})  # a prompt chunk: nothing sampled yet
    assert first.sampled_token_ids == [[]]
    driver.step({"a": 17})
    assert len(req.output) == 1
    driver.run_to_completion()
    vocab = runner.model_config.vocab_size
    assert all(0 <= t < vocab for t in req.output) and len(req.output) == 4


def test_made_up_tokens_avoid_both_ends_of_a_large_vocabulary():
    class State:
        token_ids = list(range(50))
    tokens = {made_up_token(State, 49152) for State.token_ids in
              ([0] * n for n in range(1, 500))}
    assert min(tokens) >= 1000 and max(tokens) < 49152 - 1000 and len(tokens) > 100


def test_bf16_on_cpu_rounds_only_the_matmul_weights(tiny_qwen2_dir):
    runner = _runner(tiny_qwen2_dir, dtype="bfloat16")
    w, lw = runner.model.w, runner.model.w.layers[0]
    assert {lw.qkv.dtype, lw.qkv_bias.dtype, lw.o_proj.dtype, lw.gate_up.dtype,
            lw.down.dtype, w.lm_head.dtype} == {torch.bfloat16}
    assert lw.input_norm.dtype == w.final_norm.dtype == torch.float32
    assert runner.model.dtype == torch.float32 and runner.kv_caches[0].dtype == torch.float32
    assert runner.model_info().dtype == "bfloat16"
    # bf16 matmul weights under fp32 activations keep the fp32 C ops (torch without a compiler)
    assert runner.compute_plan.fused_ops == (runner.model.fused is not None)
    assert runner.compute_plan.act_dtype == torch.float32


@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_bf16_weights_give_logits_close_to_fp32(checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    prompt = list(range(3, 60))
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = _runner(path, dtype=dtype)
        driver = StepDriver(runner)
        driver.add("a", prompt, max_new=1)
        driver.step()
        # the same forward the step ran, for the last prompt token's logits
        from .test_model_matches_transformers import _chunk_logits, _state
        state = _state(prompt)
        logits[dtype] = _chunk_logits(runner, state, len(prompt))[-1]
    err = (logits["bfloat16"] - logits["float32"]).abs().max() / logits["float32"].abs().max()
    assert 0 < float(err) < 0.05  # bf16 rounding shows, and stays small


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert cpu_dtype.native_bf16() == "avx512_bf16"
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset({"amx_bf16", "avx512_bf16"}))
    assert cpu_dtype.native_bf16() == "amx_bf16"
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset({"avx2"}))
    assert cpu_dtype.native_bf16() is None


def test_prepacked_fp32_weights_give_the_logits_of_plain_ones(tiny_qwen2_dir):
    prompt = list(range(3, 60))
    from .test_model_matches_transformers import _chunk_logits, _state
    logits = {}
    for prepack in ("on", "off"):
        # without the small-batch kernel: with it, its plain weights are the one copy
        runner = _runner(tiny_qwen2_dir, cpu_prepack=prepack == "on", cpu_small_batch=False)
        assert runner.compute_plan.prepack == runner.model.w.layers[0].gate_up.is_mkldnn
        assert runner.model.w.layers[0].gate_up.is_mkldnn == \
            (prepack == "on" and cpu_dtype.prepack_available(torch.float32))
        logits[prepack] = _chunk_logits(runner, _state(prompt), len(prompt))
    torch.testing.assert_close(logits["on"], logits["off"], rtol=1e-5, atol=1e-5)
