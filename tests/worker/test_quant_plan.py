"""Which path a GGUF takes (worker_svc/compute_plan.py, _quantized_path): quantized
types take the quantized path by default, in every family (the torch-layer ones too);
a float --dtype, a float-only file, tensor parallelism, --quantization or a missing
kernel keep the exact path, each saying why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from frontend_svc.api.openai_api import weights_metadata
from shared.types import ModelInfo
from tests.worker.test_compute_plan import ALL, Shape
from worker_svc.compute_plan import QUANT_MAX_ROWS, build_plan
from worker_svc.config import WorkerConfig

CPU = torch.device("cpu")
QUANT = dataclasses.replace(ALL, quant=True)
Q4_1 = {"Q4_1": 66_355_200, "Q8_0": 30_081_024}


@dataclasses.dataclass
class FamilyShape(Shape):
    family: str = "llama"
    model_type: str = "llama"


def plan(gguf_types=Q4_1, kernels=QUANT, shape=None, **config):
    return build_plan(WorkerConfig(**config), CPU, shape or FamilyShape(), biases=False,
                      kernels=kernels, usable_cores=2, environ={}, gguf_types=gguf_types)


def test_a_quantized_gguf_takes_the_quantized_path_for_every_step():
    p = plan()
    assert (p.weights, p.weight_types) == ("gguf_quantized", "Q4_1+Q8_0")
    assert (p.small_batch, p.small_max_rows, p.logits_max_rows) == \
        ("quant", QUANT_MAX_ROWS, QUANT_MAX_ROWS)
    assert not p.prepack and not p.argmax_screen and p.layer_loop == "c_loop"
    assert "weights=gguf_quantized:Q4_1+Q8_0" in p.summary()


@pytest.mark.parametrize("family", ["gemma", "qwen3", "qwen3_moe", "phi3"])
def test_the_torch_layer_families_take_the_quantized_path_too(family):
    p = plan(shape=FamilyShape(family=family))
    assert (p.weights, p.weight_types) == ("gguf_quantized", "Q4_1+Q8_0")
    assert not p.c_layers and p.layer_loop != "c_loop"
    assert "weights=gguf_quantized:Q4_1+Q8_0" in p.summary()


def test_gemma3_decodes_in_its_own_c_loop_sliding_windows_included():
    """Gemma 3's quantized decode steps take decode_layers_gemma_f32, windows and all;
    Gemma 2 (capped scores) and the switch keep its torch layers; so does the exact
    path, whose torch layers hold float weights."""
    gemma3 = FamilyShape(family="gemma", model_type="gemma3_text", head_dim=256)
    for windowed in (False, True):
        p = build_plan(WorkerConfig(), CPU, gemma3, biases=False, kernels=QUANT,
                       usable_cores=2, environ={}, gguf_types=Q4_1, windowed=windowed)
        assert p.layer_loop == "c_loop" and not p.c_layers and not p.fused_ops
    assert plan(shape=dataclasses.replace(gemma3, model_type="gemma2")).layer_loop == "torch"
    assert plan(shape=gemma3, cpu_decode_layers=False).layer_loop == "torch"
    assert plan(shape=gemma3, dtype="float32").layer_loop == "torch"
    assert plan(shape=gemma3, kernels=dataclasses.replace(QUANT, fused_ops=False)
                ).layer_loop == "torch"


@pytest.mark.parametrize("case", [
    dict(dtype="float32"), dict(dtype="bfloat16"), dict(gguf_types={"F16": 10}),
    dict(gguf_types=None), dict(kernels=ALL), dict(quantization="int8")], ids=str)
def test_the_exact_path_serves_otherwise(case):
    p = plan(**case)
    assert p.weights == "float" and p.small_batch != "quant"
    assert "weights=" not in p.summary()


def test_models_metadata_names_the_path_in_fields_clients_ignore():
    info = ModelInfo(model_name="m", vocab_size=1, max_model_len=8, eos_token_ids=[2],
                     num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32",
                     num_kv_blocks=1, block_size=16, max_num_batched_tokens=8,
                     compute_plan=plan().summary())
    assert weights_metadata(info) == {"quantization": "gguf",
                                      "weights": "gguf_quantized:Q4_1+Q8_0",
                                      "quant_activations": "float32"}
    info.compute_plan = plan(quant_activations="int8").summary()
    assert weights_metadata(info) == {"quantization": "gguf",
                                      "weights": "gguf_quantized:Q4_1+Q8_0",
                                      "quant_activations": "int8"}
    info.compute_plan = plan(dtype="float32").summary()
    assert weights_metadata(info) == {"quantization": None, "weights": "float32",
                                      "quant_activations": None}
    assert weights_metadata(None) == {"quantization": None, "weights": None,
                                      "quant_activations": None}


def test_int8_activations_ride_the_quantized_path_and_say_so():
    p = plan(quant_activations="int8")
    assert (p.weights, p.quant_activations) == ("gguf_quantized", "int8")
    assert "quant_activations=int8" in p.summary()
    assert p.log_fields()["quant_activations"] == "int8"
    assert "quant_activations" not in plan().summary()  # float32: the default, unsaid


@pytest.mark.parametrize("case", [
    dict(dtype="float32"), dict(gguf_types={"F16": 10}), dict(gguf_types=None),
    dict(kernels=ALL), dict(quantization="int8")], ids=str)
def test_int8_activations_off_the_quantized_path_are_refused_by_name(case):
    """Asked for where no quantized kernel runs (a float checkpoint or --dtype, or the
    path is off): refused, never silently ignored."""
    with pytest.raises(ValueError, match="--quant-activations int8"):
        plan(quant_activations="int8", **case)


def test_an_unknown_activation_format_is_refused():
    with pytest.raises(ValueError, match="quant_activations must be float32 or int8"):
        WorkerConfig(quant_activations="int4").validate()
