"""Start-up: KV capacity from the budgets, model facts reported to the scheduler,
and clear refusals of settings that cannot work."""

import pytest
import torch

from worker_svc.config import WorkerConfig
from worker_svc.kv_capacity import bytes_per_block
from worker_svc.runner import ModelRunner


def _config(path, **kw):
    base = dict(model=str(path), device="cpu", max_model_len=128, max_num_seqs=4)
    base.update(kw)
    return WorkerConfig(**base)


def test_cpu_kv_blocks_come_from_the_byte_budget(tiny_llama_dir):
    runner = ModelRunner(_config(tiny_llama_dir, kv_cache_memory=3 << 20))
    per_block = bytes_per_block(runner.model_config, 16, torch.float32)
    assert per_block == 3 * 2 * 16 * 2 * 16 * 4  # layers, k+v, slots, kv heads, head_dim, fp32
    assert runner.num_kv_blocks == min((3 << 20) // per_block, 4 * (128 // 16) + 1)
    assert runner.kv_caches[0].shape == (2, runner.num_kv_blocks, 16, 2, 16)


def test_num_gpu_blocks_override_wins_over_the_budget(tiny_llama_dir):
    runner = ModelRunner(_config(tiny_llama_dir, kv_cache_memory=1 << 30,
                                 num_gpu_blocks_override=20))
    assert runner.num_kv_blocks == 20


def test_model_info_reports_model_facts(tiny_qwen2_dir):
    info = ModelRunner(_config(tiny_qwen2_dir, num_gpu_blocks_override=20,
                               block_size=8)).model_info()
    assert (info.vocab_size, info.num_layers, info.num_kv_heads, info.head_dim) == (256, 3, 2, 16)
    assert (info.max_model_len, info.num_kv_blocks, info.block_size) == (128, 20, 8)
    assert info.eos_token_ids == [2] and info.dtype == "float32"


@pytest.mark.parametrize("kw, message", [
    (dict(num_gpu_blocks_override=4), "less than one sequence"),
    (dict(max_model_len=100_000), "max_model_len must be"),
    (dict(block_size=12), "power of two"),
    (dict(dtype="int8"), "dtype"),
])
def test_impossible_settings_are_refused_at_start_up(tiny_llama_dir, kw, message):
    with pytest.raises(ValueError, match=message):
        ModelRunner(_config(tiny_llama_dir, **kw))


def test_float16_runs_on_cpu_through_the_torch_attention_path(tiny_llama_dir):
    # (bfloat16 on CPU keeps fp32 activations and runs the fp32 kernels: cpu_dtype.py)
    from tests.worker.step_driver import StepDriver
    runner = ModelRunner(_config(tiny_llama_dir, dtype="float16", num_gpu_blocks_override=20))
    assert runner.kv_caches[0].dtype == torch.float16
    driver = StepDriver(runner)
    driver.add("a", list(range(3, 30)), max_new=4)
    driver.add("b", list(range(40, 45)), max_new=4)
    driver.run_to_completion()
    assert all(len(r.output) == 4 for r in driver.requests.values())


def test_the_start_up_log_line_names_the_compute_plan_the_steps_follow(tiny_llama_dir):
    from structlog.testing import capture_logs
    from worker_svc.compute_plan import probe_kernels
    kernels = probe_kernels()
    if not (kernels.attention and kernels.fused_ops):
        pytest.skip("no C compiler here: only the torch paths exist")
    with capture_logs() as logs:
        fp32 = ModelRunner(_config(tiny_llama_dir, num_gpu_blocks_override=20))
    lines = [e for e in logs if e["event"] == "compute_plan"]
    assert len(lines) == 1  # one line says it all
    assert lines[0]["attention"] == "c_decode_kernel" and lines[0]["fused_ops"] is True
    assert lines[0]["layer_loop"] == fp32.compute_plan.layer_loop
    assert fp32.model_info().compute_plan == fp32.compute_plan.summary()
    assert "attention=c_decode_kernel" in fp32.model_info().compute_plan
    off = ModelRunner(_config(tiny_llama_dir, num_gpu_blocks_override=20,
                              cpu_attention=False, cpu_fused_ops=False))
    assert (off.compute_plan.attention, off.compute_plan.layer_loop) == ("torch_sdpa", "torch")
    assert off.model.fused is None and off.model.backend.decode_kernel is None
    half = ModelRunner(_config(tiny_llama_dir, num_gpu_blocks_override=20, dtype="float16"))
    assert half.compute_plan.layer_loop == "torch" and half.model.fused is None
    # bf16 matmul weights under fp32 activations keep the fp32 C kernels
    bf16 = ModelRunner(_config(tiny_llama_dir, num_gpu_blocks_override=20, dtype="bfloat16"))
    assert (bf16.compute_plan.attention, bf16.compute_plan.layer_loop) == (
        fp32.compute_plan.attention, fp32.compute_plan.layer_loop)
