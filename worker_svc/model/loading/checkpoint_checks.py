"""Refuse, before a byte of weights is read, a checkpoint the model would serve wrongly.

Every family reads its checkpoint through weights.CheckpointSlices, which applies
these rules at one point. A quantized checkpoint is loaded by its method in
worker_svc/model/quantization/ (dequantized to float at load), or refused there by
name; what no method took is refused here, with a message naming the format or the
tensor, when
1. a tensor still has a quantization format's name (`qweight`, `weight_scale`, `SCB`,
   ...) after the checkpoint's method took its own: quantized tensors without a
   quantization_config saying how to read them, or of another format than it;
2. a configured method found no linear in its format (a config that lies);
3. a tensor the model reads is not a floating-point dtype (fp8 included: codes
   without their scales), and, for the families that state their tensors
   (expected_shapes: the llama family), missing or not the shape the config implies.
Tensors the model does not read are logged, not refused (old checkpoints carry
`rotary_emb.inv_freq`).
"""

from __future__ import annotations

from pathlib import Path

from shared.telemetry import get_logger
from worker_svc.model.config import ModelConfig
from worker_svc.model.loading.safetensors_io import CheckpointError, TensorEntry

log = get_logger(service="worker")

# safetensors dtypes a weight may have: converted to the model's dtype exactly
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})

# the last part of a tensor's name -> the quantization format that writes it
QUANTIZED_TENSOR_NAMES = {
    "qweight": "GPTQ/AWQ", "qzeros": "GPTQ/AWQ", "scales": "GPTQ/AWQ", "g_idx": "GPTQ",
    "weight_scale": "FP8/int8 (compressed-tensors or fbgemm)",
    "weight_scale_inv": "FP8 block-quantized", "input_scale": "FP8/int8 activation scales",
    "weight_zero_point": "compressed-tensors", "weight_packed": "compressed-tensors",
    "weight_shape": "compressed-tensors", "weight_global_scale": "NVFP4",
    "input_global_scale": "NVFP4", "k_scale": "FP8 KV cache", "v_scale": "FP8 KV cache",
    "SCB": "bitsandbytes 8-bit", "weight_format": "bitsandbytes 8-bit",
    "absmax": "bitsandbytes 4-bit", "quant_map": "bitsandbytes 4-bit",
    "nested_absmax": "bitsandbytes 4-bit", "nested_quant_map": "bitsandbytes 4-bit",
}


def check_checkpoint(model_dir: Path, cfg: ModelConfig,
                     entries: dict[str, TensorEntry]) -> None:
    """Raise CheckpointError naming the first reason the checkpoint cannot be served
    as floats by the llama family; `entries` are its tensors as CheckpointSlices lists
    them (quantized linears already their float weights)."""
    expected = expected_shapes(cfg)
    check_shapes(model_dir, entries, expected, lambda name: _optional(name, cfg))
    unused = sorted(set(entries) - set(expected))
    log.info("checkpoint_checked", model_dir=str(model_dir), tensors=len(entries),
             dtypes=sorted({e.dtype for e in entries.values()}), unused=unused[:8],
             num_unused=len(unused))


def check_shapes(model_dir: Path, entries: dict[str, TensorEntry],
                 expected: dict[str, tuple[int, ...]], optional=lambda name: False) -> None:
    """Rule 3 for a family that states its tensors: each present, float, of its shape."""
    for name, shape in expected.items():
        e = entries.get(name)
        if e is None:
            if optional(name):
                continue
            raise CheckpointError(f"checkpoint in {model_dir} lacks tensor {name} "
                                  f"(shape {list(shape)})")
        refuse_non_float(name, e)
        if e.shape != shape:
            raise CheckpointError(f"{e.path}: tensor {name} has shape {list(e.shape)}, but "
                                  f"config.json implies {list(shape)}")


def refuse_unread_quantized(model_dir: Path, entries: dict[str, TensorEntry],
                            method_name: str | None) -> None:
    """Rule 1: a quantization format's tensor that no configured method took."""
    for name in entries:
        if (fmt := quantized_format(name)) is not None:
            how = (f"not in the format of its quant_method={method_name!r}" if method_name
                   else "without a quantization_config in config.json saying how to read it")
            raise CheckpointError(f"checkpoint in {model_dir} is quantized ({fmt}): tensor "
                                  f"{name}, {how}; such checkpoints are not supported")


def refuse_non_float(name: str, e: TensorEntry) -> None:
    """Rule 3's dtype part, for a tensor the model is about to read (a GGUF tensor's
    ggml type is dequantized to float on read: safetensors_io)."""
    if e.dtype not in FLOAT_DTYPES and e.ggml_type is None:
        raise CheckpointError(f"{e.path}: tensor {name} has dtype {e.dtype}, not a float "
                              "dtype (a quantized weight without its scales or its "
                              "quantization_config?); such checkpoints are not supported")


def quantized_format(name: str) -> str | None:
    """The quantization format whose tensor this name is, or None."""
    last = name.rsplit(".", 1)[-1]
    if last.startswith("bitsandbytes__"):  # bitsandbytes 4-bit's packed quant_state
        return f"bitsandbytes 4-bit ({last.removeprefix('bitsandbytes__')})"
    return QUANTIZED_TENSOR_NAMES.get(last)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the Llama-family model reads (weights.load_weights), with the shape
    config.json implies; biases and an untied lm_head only where the model has them."""
    h, i, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
           "lm_head.weight": (v, h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        a, m = p + "self_attn.", p + "mlp."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h),
                a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q),
                a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                a + "o_proj.bias": (h,), m + "gate_proj.weight": (i, h),
                m + "up_proj.weight": (i, h), m + "down_proj.weight": (h, i),
                m + "gate_proj.bias": (i,), m + "up_proj.bias": (i,), m + "down_proj.bias": (h,)}
    return out


def _optional(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may lack: biases (the loader pairs fused ones) and a tied
    lm_head (the embedding serves it)."""
    return name.endswith(".bias") or (name == "lm_head.weight" and cfg.tie_word_embeddings)
