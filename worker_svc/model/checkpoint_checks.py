"""Refuse, before a byte of weights is read, a checkpoint the model would serve wrongly.

Until quantized formats are supported, reading one as floats is garbage with no
warning: FP8, int8 (W8A8) and bitsandbytes 8-bit weights are integers or fp8 codes
whose scales sit in other tensors, and GPTQ/AWQ have no `weight` at all. So a
checkpoint is refused, with a message naming the format or the tensor, when
1. its config carries a `quantization_config` (or a quantize_config.json sits beside
   it): the message names the `quant_method`;
2. a tensor has a quantization format's name (`qweight`, `weight_scale`, `SCB`, ...);
3. a tensor the model reads is missing, not a floating-point dtype (fp8 included:
   codes without their scales), or not the shape the config implies.
Tensors the model does not read are logged, not refused (old checkpoints carry
`rotary_emb.inv_freq`).
"""

from __future__ import annotations

from pathlib import Path

from shared.telemetry import get_logger
from worker_svc.model.config import ModelConfig
from worker_svc.model.safetensors_io import CheckpointError, TensorEntry

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
# files older GPTQ/AWQ tools write instead of a quantization_config
QUANTIZE_CONFIG_FILES = ("quantize_config.json", "quant_config.json")


def check_checkpoint(model_dir: Path, cfg: ModelConfig,
                     entries: dict[str, TensorEntry]) -> None:
    """Raise CheckpointError naming the first reason the checkpoint cannot be served
    as floats by this model; `entries` are all its tensors (weights.checkpoint_entries)."""
    refuse_quantization_config(model_dir, cfg.hf_config)
    for name in entries:
        if (fmt := quantized_format(name)) is not None:
            raise CheckpointError(f"checkpoint in {model_dir} is quantized ({fmt}): tensor "
                                  f"{name}; quantized checkpoints are not supported yet, "
                                  "use a float16/bfloat16/float32 one")
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        e = entries.get(name)
        if e is None:
            if _optional(name, cfg):
                continue
            raise CheckpointError(f"checkpoint in {model_dir} lacks tensor {name} "
                                  f"(shape {list(shape)})")
        if e.dtype not in FLOAT_DTYPES and e.ggml_type is None:  # GGUF: dequantized on read
            raise CheckpointError(f"{e.path}: tensor {name} has dtype {e.dtype}, not a float "
                                  "dtype (a quantized weight without its scales?); quantized "
                                  "checkpoints are not supported yet")
        if e.shape != shape:
            raise CheckpointError(f"{e.path}: tensor {name} has shape {list(e.shape)}, but "
                                  f"config.json implies {list(shape)}")
    unused = sorted(set(entries) - set(expected))
    log.info("checkpoint_checked", model_dir=str(model_dir), tensors=len(entries),
             dtypes=sorted({e.dtype for e in entries.values()}), unused=unused[:8],
             num_unused=len(unused))


def refuse_quantization_config(model_dir: Path, hf_config) -> None:
    """Part 1 of the rule: a quantization_config (or compression_config) in config.json,
    or a GPTQ/AWQ tool's own quantize config file."""
    for key in ("quantization_config", "compression_config"):
        qc = getattr(hf_config, key, None)
        if qc:
            raise CheckpointError(f"checkpoint in {model_dir} is quantized ({key} with "
                                  f"{_describe(qc)}); quantized checkpoints are not "
                                  "supported yet, use a float16/bfloat16/float32 one")
    for file in QUANTIZE_CONFIG_FILES:
        if (model_dir / file).is_file():
            raise CheckpointError(f"checkpoint in {model_dir} is quantized ({file}); quantized "
                                  "checkpoints are not supported yet")


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


def _describe(qc) -> str:
    """quant_method and bits of a quantization_config (a dict, or transformers' object)."""
    d = qc if isinstance(qc, dict) else getattr(qc, "to_dict", lambda: vars(qc))()
    parts = [f"quant_method={d.get('quant_method', 'unknown')!r}"]
    for key in ("bits", "load_in_8bit", "load_in_4bit", "fmt", "format"):
        if d.get(key):
            parts.append(f"{key}={d[key]!r}")
    return ", ".join(parts)
