"""Qwen3 (dense): Llama's layer with a per-head RMSNorm on q and k before RoPE, no
q/k/v bias (unless attention_bias), on the torch path (torch_decoder.py). With
use_sliding_window, the layers its layer_types marks sliding_attention (transformers
derives them: from max_window_layers on) attend within sliding_window."""

from __future__ import annotations

from worker_svc.model import torch_decoder
from worker_svc.model.loading.weights import CheckpointSlices
from worker_svc.model.config import ModelConfig, require_silu

PACKED_MODULES_MAPPING = {**torch_decoder.LLAMA_NAMES,
                          "q_norm": ("self_attn.q_norm",), "k_norm": ("self_attn.k_norm",)}


def configure(hf, cfg: ModelConfig) -> ModelConfig:
    require_silu(hf)
    sliding_layers(hf, cfg)
    cfg.qk_norm = True
    cfg.qkv_bias = bool(getattr(hf, "attention_bias", False))
    return cfg


def sliding_layers(hf, cfg: ModelConfig) -> None:
    """transformers' rule (Qwen3Config, Qwen3Attention): sliding_window is None unless
    use_sliding_window; a layer layer_types marks sliding_attention attends within it,
    the others (and every layer when the window is None) see every key."""
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * cfg.num_layers)
    if set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{hf.model_type} layer_types {sorted(set(types))} are not "
                         "supported; only sliding_attention and full_attention")
    window = getattr(hf, "sliding_window", None)
    if window and "sliding_attention" in types:
        cfg.sliding_window = int(window)
        cfg.sliding_layers = tuple(t == "sliding_attention" for t in types)


def load_weights(model_dir, cfg, dtype, device, shard=None, matmul_dtype=None,
                 slices=CheckpointSlices):
    return torch_decoder.load_weights(model_dir, cfg, dtype, device, shard, matmul_dtype,
                                      PACKED_MODULES_MAPPING, slices)


Model = torch_decoder.TorchDecoder
