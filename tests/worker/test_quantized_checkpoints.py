"""A quantized checkpoint in each supported on-disk layout is dequantized at load and
serves, under float32, the greedy tokens transformers computes on its dequantized
float twin (W8A8 and FP8-dynamic included: activation quantization is the fast
path's). tests/families/test_quantized_families.py: the other families."""

from __future__ import annotations

import pytest
import torch

from tests.worker.quantized_checkpoints import LAYOUTS, write_quantized
from tests.worker.step_driver import run_outputs, tiny_cpu_runner


def _hf_greedy(path, prompts, n):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            outs.append(out[0, len(p):].tolist())
    return outs


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 19, 33)]


def _weights_differ(twin, src) -> bool:
    from safetensors.torch import load_file
    a, b = load_file(str(twin / "model.safetensors")), load_file(str(src / "model.safetensors"))
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_quantized_llama_is_greedy_token_equal_to_its_dequantized_twin(
        layout, tiny_llama_dir, tmp_path):
    quant, twin = tmp_path / "quant", tmp_path / "twin"
    write_quantized(tiny_llama_dir, quant, twin, layout)
    assert _weights_differ(twin, tiny_llama_dir)  # the codes are not the float weights
    got = run_outputs(tiny_cpu_runner(quant, dtype="float32"), _prompts(), 12)
    assert got == _hf_greedy(twin, _prompts(), 12)


def _library_dequantized(layout: str):
    """transformers' own dequantizing config for a layout: compressed-tensors
    decompressed (the compressed-tensors package), FineGrainedFP8 dequantized."""
    from transformers.utils.quantization_config import (CompressedTensorsConfig,
                                                        FineGrainedFP8Config)
    if layout.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
        return CompressedTensorsConfig(run_compressed=False)
    pytest.importorskip("accelerate")  # transformers' FP8 loader asks for it
    return FineGrainedFP8Config(dequantize=True, weight_block_size=(32, 32))


LIBRARY_LAYOUTS = [k for k in LAYOUTS if k.startswith("ct-")] + ["fp8-block-scale-inv"]


@pytest.mark.parametrize("layout", LIBRARY_LAYOUTS)
def test_the_librarys_own_dequantization_gives_the_twins_weights_and_tokens(
        layout, tiny_llama_dir, tmp_path):
    # transformers reading the quantized checkpoint itself, dequantized to float, is
    # the twin: the layout is the library's, not ours alone
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    config = _library_dequantized(layout)
    quant, twin = tmp_path / "quant", tmp_path / "twin"
    write_quantized(tiny_llama_dir, quant, twin, layout)
    model = AutoModelForCausalLM.from_pretrained(str(quant), dtype=torch.float32,
                                                 quantization_config=config).eval()
    theirs, ours = model.state_dict(), load_file(str(twin / "model.safetensors"))
    for name, w in ours.items():
        assert torch.equal(theirs[name].float(), w), name
    got = run_outputs(tiny_cpu_runner(quant, dtype="float32"), _prompts(), 12)
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long)
                               )[0, len(p):].tolist() for p in _prompts()]
    assert got == want


def test_an_autogptq_checkpoint_with_only_quantize_config_json_loads_as_gptq(
        tiny_llama_dir, tmp_path):
    import json
    quant, twin = tmp_path / "quant", tmp_path / "twin"
    write_quantized(tiny_llama_dir, quant, twin, "gptq-4bit-desc-act")
    config = json.loads((quant / "config.json").read_text())
    (quant / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (quant / "config.json").write_text(json.dumps(config))
    got = run_outputs(tiny_cpu_runner(quant, dtype="float32"), _prompts(), 12)
    assert got == _hf_greedy(twin, _prompts(), 12)
