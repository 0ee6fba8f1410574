"""A checkpoint the model would serve wrongly is refused at load, naming the format or
the tensor: a quantization_config's method not supported (or one whose tensors are
absent), a quantization format's tensor names without a config,
a non-float weight (int8, uint8, fp8), a missing tensor, a shape the config does not
imply. Each is a tiny llama saved by transformers, then edited into that layout."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.ports import free_ports
from worker_svc.model.config import load_model_config
from worker_svc.model.loading.safetensors_io import CheckpointError
from worker_svc.model.loading.weights import load_weights

Q = "model.layers.0.self_attn.q_proj"
REPO = Path(__file__).resolve().parents[2]


def _load(model_dir: Path):
    return load_weights(model_dir, load_model_config(model_dir), torch.float32,
                        torch.device("cpu"))


@pytest.fixture
def edited(tiny_llama_dir, tmp_path):
    """A copy of tiny_llama_dir; the test edits its config.json or its tensors."""
    dst = tmp_path / "edited"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def _edit_config(model_dir: Path, **fields) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def _edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


QUANTIZATION_CONFIGS = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "int-quantized",
                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                               "num_bits": 8, "type": "int", "strategy": "channel"}}}},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_8bit": True},
}


@pytest.mark.parametrize("method", list(QUANTIZATION_CONFIGS))
def test_a_supported_quantization_config_over_float_tensors_is_refused_naming_it(
        edited, method):
    # the config says quantized, the tensors say float: one of them lies
    _edit_config(edited, quantization_config=QUANTIZATION_CONFIGS[method])
    with pytest.raises(CheckpointError, match=f"quant_method='{method}'.*no tensor in"):
        _load(edited)


@pytest.mark.parametrize("config, named", [
    ({"quant_method": "hqq", "nbits": 4}, "quant_method='hqq'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "awq version='gemv'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}},
     "compressed-tensors format='nvfp4-pack-quantized'"),
], ids=["hqq", "gptq-3bit", "awq-gemv", "nvfp4"])
def test_an_unsupported_quantization_method_or_variant_is_refused_by_name(
        edited, config, named):
    _edit_config(edited, quantization_config=config)
    with pytest.raises(CheckpointError, match=named):
        _load(edited)


def test_an_autogptq_quantize_config_file_over_float_tensors_is_refused_naming_it(edited):
    # read as the GPTQ config it is (AutoGPTQ writes it instead of a quantization_config)
    (edited / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(CheckpointError, match="quant_method='gptq' in quantize_config.json"):
        _load(edited)


def _int8_with_scale(t):  # W8A8 / fbgemm FP8 layout: int8 codes plus a per-row scale
    w = t.pop(f"{Q}.weight")
    t[f"{Q}.weight"] = (w * 100).round().clamp(-127, 127).to(torch.int8)
    t[f"{Q}.weight_scale"] = torch.full((w.shape[0], 1), 0.01)


def _fp8_with_scale_inv(t):  # DeepSeek-style block FP8: codes plus weight_scale_inv
    t[f"{Q}.weight"] = t[f"{Q}.weight"].to(torch.float8_e4m3fn)
    t[f"{Q}.weight_scale_inv"] = torch.ones(1, 1)


def _bnb_int8(t):  # bitsandbytes 8-bit: int8 codes and SCB row scales
    t[f"{Q}.weight"] = t[f"{Q}.weight"].mul(100).round().to(torch.int8)
    t[f"{Q}.SCB"] = torch.ones(t[f"{Q}.weight"].shape[0])


def _bnb_nf4(t):  # bitsandbytes 4-bit: packed uint8 plus absmax and a quant_state
    w = t.pop(f"{Q}.weight")
    t[f"{Q}.weight"] = torch.zeros(w.numel() // 2, 1, dtype=torch.uint8)
    t[f"{Q}.weight.absmax"] = torch.ones(w.numel() // 64)
    t[f"{Q}.weight.quant_state.bitsandbytes__nf4"] = torch.zeros(8, dtype=torch.uint8)


def _gptq(t):  # GPTQ/AWQ: no weight at all, only packed int32 qweight and friends
    w = t.pop(f"{Q}.weight")
    t[f"{Q}.qweight"] = torch.zeros(w.shape[1] // 8, w.shape[0], dtype=torch.int32)
    t[f"{Q}.qzeros"] = torch.zeros(1, w.shape[0] // 8, dtype=torch.int32)
    t[f"{Q}.scales"] = torch.ones(1, w.shape[0], dtype=torch.float16)
    t[f"{Q}.g_idx"] = torch.zeros(w.shape[1], dtype=torch.int32)


@pytest.mark.parametrize("edit, named", [
    (_int8_with_scale, r"FP8/int8 .*weight_scale"),
    (_fp8_with_scale_inv, r"FP8 block-quantized.*weight_scale_inv"),
    (_bnb_int8, r"bitsandbytes 8-bit.*SCB"),
    (_bnb_nf4, r"bitsandbytes 4-bit"),
    (_gptq, r"GPTQ.*q_proj\.(qweight|qzeros|scales|g_idx)"),
], ids=["int8-w8a8", "fp8-block", "bnb-8bit", "bnb-4bit", "gptq"])
def test_quantized_tensors_without_a_config_are_refused_naming_format_and_tensor(
        edited, edit, named):
    _edit_tensors(edited, edit)
    with pytest.raises(CheckpointError, match=named):
        _load(edited)


@pytest.mark.parametrize("dtype, name", [(torch.int8, "I8"), (torch.uint8, "U8"),
                                         (torch.float8_e4m3fn, "F8_E4M3"),
                                         (torch.float8_e5m2, "F8_E5M2")])
def test_a_non_float_weight_alone_is_refused_naming_tensor_and_dtype(edited, dtype, name):
    # no scale tensors and no config: only the dtype gives it away
    def edit(t):
        t[f"{Q}.weight"] = t[f"{Q}.weight"].mul(10).to(dtype)
    _edit_tensors(edited, edit)
    with pytest.raises(CheckpointError, match=rf"{Q}\.weight has dtype {name}, not a float"):
        _load(edited)


def test_a_shape_the_config_does_not_imply_is_refused_naming_both_shapes(edited):
    def edit(t):  # a consistent file, but k_proj has the rows of 4 kv heads, not 2
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    _edit_tensors(edited, edit)
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.k_proj\.weight has "
                                              r"shape \[64, 64\], but config.json implies "
                                              r"\[32, 64\]"):
        _load(edited)


def test_an_untied_model_without_lm_head_is_refused_naming_it(edited):
    _edit_config(edited, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="lacks tensor lm_head.weight"):
        _load(edited)


def test_the_worker_process_exits_with_the_refusal_as_its_message(edited):
    # the real entry point: an unsupported quantized checkpoint ends the process with a
    # named refusal, not a KeyError traceback
    _edit_config(edited, quantization_config={"quant_method": "hqq", "nbits": 4})
    port, metrics = free_ports(2)
    result = subprocess.run(
        [sys.executable, "-m", "worker_svc.server", "--model", str(edited),
         "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2, result.stderr
    assert last.startswith("gapserve worker: ") and "quant_method='hqq'" in last, last
    assert "Traceback" not in result.stderr
