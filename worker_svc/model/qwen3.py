"""Qwen3 (dense): Llama's layer with a per-head RMSNorm on q and k before RoPE, no
q/k/v bias (unless attention_bias), on the torch path (torch_decoder.py)."""

from __future__ import annotations

from worker_svc.model import torch_decoder
from worker_svc.model.config import ModelConfig, require_silu

PACKED_MODULES_MAPPING = {**torch_decoder.LLAMA_NAMES,
                          "q_norm": ("self_attn.q_norm",), "k_norm": ("self_attn.k_norm",)}


def configure(hf, cfg: ModelConfig) -> ModelConfig:
    require_silu(hf)
    refuse_sliding_window(hf)
    cfg.qk_norm = True
    cfg.qkv_bias = bool(getattr(hf, "attention_bias", False))
    return cfg


def refuse_sliding_window(hf) -> None:
    """Qwen3's sliding layers (use_sliding_window, from max_window_layers on) are not
    implemented: refused rather than served with full attention."""
    types = set(getattr(hf, "layer_types", None) or ["full_attention"])
    if getattr(hf, "use_sliding_window", False) or types != {"full_attention"}:
        raise ValueError(f"{hf.model_type} sliding-window attention (use_sliding_window, "
                         "layer_types sliding_attention) is not supported")


def load_weights(model_dir, cfg, dtype, device, shard=None, matmul_dtype=None):
    return torch_decoder.load_weights(model_dir, cfg, dtype, device, shard, matmul_dtype,
                                      PACKED_MODULES_MAPPING)


Model = torch_decoder.TorchDecoder
