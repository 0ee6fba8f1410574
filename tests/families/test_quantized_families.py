"""Every family reads its checkpoint through the same quantization methods and the same
refusals (weights.CheckpointSlices): a quantized Qwen3 serves its dequantized twin's
greedy tokens; a Qwen3 or Gemma checkpoint with an unsupported quantization_config,
quantized tensors without a config, or an int8 weight is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.families.dense_checkpoints import write as write_dense
from tests.worker.quantized_checkpoints import write_quantized
from tests.worker.step_driver import run_outputs, tiny_cpu_runner
from tests.worker.test_quantized_checkpoints import _hf_greedy, _prompts
from worker_svc.model.loading.safetensors_io import CheckpointError


@pytest.mark.parametrize("layout", ["gptq-4bit-desc-act", "ct-w8a8-int8", "bnb-nf4"])
def test_a_quantized_qwen3_is_greedy_token_equal_to_its_dequantized_twin(
        layout, family_dir, tmp_path):
    quant, twin = tmp_path / "quant", tmp_path / "twin"
    write_quantized(family_dir("qwen3"), quant, twin, layout)
    got = run_outputs(tiny_cpu_runner(quant, dtype="float32"), _prompts(), 12)
    assert got == _hf_greedy(twin, _prompts(), 12)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return write_dense("gemma3_text", tmp_path_factory.mktemp("gemma3_text"))


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return write_dense("phi3_longrope", tmp_path_factory.mktemp("phi3_longrope"))


def test_a_quantized_qwen3_moe_dequantizes_every_experts_linear(family_dir, tmp_path):
    quant, twin = tmp_path / "quant", tmp_path / "twin"
    write_quantized(family_dir("qwen3_moe"), quant, twin, "gptq-4bit")
    got = run_outputs(tiny_cpu_runner(quant, dtype="float32"), _prompts(), 12)
    assert got == _hf_greedy(twin, _prompts(), 12)


def test_a_quantized_fused_qkv_and_gate_up_phi3_is_split_after_dequantizing(
        phi3_dir, tmp_path):
    quant, twin = tmp_path / "quant", tmp_path / "twin"
    write_quantized(phi3_dir, quant, twin, "awq-gemm")
    got = run_outputs(tiny_cpu_runner(quant, dtype="float32"), _prompts(), 12)
    assert got == _hf_greedy(twin, _prompts(), 12)


@pytest.fixture(params=["qwen3", "gemma3_text"])
def edited(request, family_dir, gemma_dir, tmp_path):
    src = family_dir("qwen3") if request.param == "qwen3" else gemma_dir
    dst = tmp_path / request.param
    shutil.copytree(src, dst)
    return dst


def _edit(model_dir, config=None, tensors=None):
    if config:
        path = model_dir / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        path = model_dir / "model.safetensors"
        t = load_file(str(path))
        tensors(t)
        save_file(t, str(path), metadata={"format": "pt"})


Q = "model.layers.0.self_attn.q_proj"


def test_an_unsupported_quantization_config_is_refused_by_name_in_every_family(edited):
    _edit(edited, config={"quantization_config": {"quant_method": "hqq", "nbits": 4}})
    with pytest.raises(CheckpointError, match="quant_method='hqq'"):
        tiny_cpu_runner(edited, dtype="float32")


def test_a_supported_config_over_float_tensors_is_refused_in_every_family(edited):
    _edit(edited, config={"quantization_config": {"quant_method": "gptq", "bits": 4,
                                                  "group_size": 32}})
    with pytest.raises(CheckpointError, match="quant_method='gptq'.*no tensor"):
        tiny_cpu_runner(edited, dtype="float32")


def test_quantized_tensors_without_a_config_are_refused_by_name_in_every_family(edited):
    def add_scale(t):
        w = t[f"{Q}.weight"]
        t[f"{Q}.weight"] = (w * 100).round().to(torch.int8)
        t[f"{Q}.weight_scale"] = torch.full((w.shape[0], 1), 0.01)
    _edit(edited, tensors=add_scale)
    with pytest.raises(CheckpointError, match=rf"FP8/int8.*{Q}\.weight_scale"):
        tiny_cpu_runner(edited, dtype="float32")


def test_an_int8_weight_alone_is_refused_naming_tensor_and_dtype_in_every_family(edited):
    def to_int8(t):
        t[f"{Q}.weight"] = (t[f"{Q}.weight"] * 100).round().to(torch.int8)
    _edit(edited, tensors=to_int8)
    with pytest.raises(CheckpointError, match=rf"{Q}\.weight has dtype I8, not a float"):
        tiny_cpu_runner(edited, dtype="float32")


def test_a_shape_the_config_does_not_imply_is_refused_naming_both_in_every_family(edited):
    def wrong_rows(t):  # a consistent file, but k_proj has twice the rows its heads imply
        k = t["model.layers.1.self_attn.k_proj.weight"]
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(2 * k.shape[0], k.shape[1])
    _edit(edited, tensors=wrong_rows)
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.k_proj\.weight has "
                                              r"shape \[\d+, \d+\], but config.json implies"):
        tiny_cpu_runner(edited, dtype="float32")


@pytest.mark.e2e
def test_two_tensor_parallel_ranks_slice_the_dequantized_weights_like_float_ones(
        phi3_dir, tmp_path):
    # each rank takes its rows (fused qkv split, then heads) and its columns (o_proj,
    # down_proj) of the dequantized weights: greedy equal to transformers on the twin
    from shared.types import SamplingParams
    from tests.integration.hf_reference import hf_greedy
    from tests.integration.test_tensor_parallel import _addresses, _ranks
    from tests.integration.tp_group import RankGroupClient
    from tests.spec.engine_loop import run
    quant, twin = tmp_path / "quant", tmp_path / "twin"
    write_quantized(phi3_dir, quant, twin, "gptq-4bit-desc-act")
    stack = _ranks(quant, tmp_path / "logs", flags=["--dtype", "float32"])
    try:
        group = RankGroupClient(_addresses(stack))
        params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
                  for _ in _prompts()]
        got, _, _ = run(group, _prompts(), params, num_blocks=32, max_model_len=96)
        group.close()
    finally:
        stack.stop()
    want = _hf_greedy(twin, _prompts(), 12)
    assert [got[f"r{i}"] for i in range(len(want))] == want
