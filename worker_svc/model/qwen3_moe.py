"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) and, in the layers the config
makes sparse, routed experts (layers.moe): softmax over the experts, top-k, the top-k
probabilities renormalised only under norm_topk_prob; the other layers (mlp_only_layers,
or off decoder_sparse_step) keep a dense MLP of intermediate_size. With
use_sliding_window every layer attends within sliding_window (transformers' rule)."""

from __future__ import annotations

from worker_svc.model import torch_decoder
from worker_svc.model.loading.weights import CheckpointSlices
from worker_svc.model.config import ModelConfig, require_silu
from worker_svc.model.layers import MoeSpec
from worker_svc.model.qwen3 import PACKED_MODULES_MAPPING as QWEN3_NAMES

PACKED_MODULES_MAPPING = {**QWEN3_NAMES,
                          "router": ("mlp.gate",),
                          "expert_gate_up": ("mlp.experts.{e}.gate_proj",
                                             "mlp.experts.{e}.up_proj"),
                          "expert_down": ("mlp.experts.{e}.down_proj",)}


def configure(hf, cfg: ModelConfig) -> ModelConfig:
    require_silu(hf)
    # transformers' Qwen3MoeAttention windows every layer by config.sliding_window (None
    # unless use_sliding_window); it has no layer_types or max_window_layers rule
    if getattr(hf, "sliding_window", None):
        cfg.sliding_window = int(hf.sliding_window)
    if getattr(hf, "shared_expert_intermediate_size", 0):
        raise ValueError("qwen3_moe shared experts (shared_expert_intermediate_size) are "
                         "not supported")
    cfg.qk_norm = True
    cfg.qkv_bias = bool(getattr(hf, "attention_bias", False))
    num_experts = int(hf.num_experts)
    cfg.moe = MoeSpec(num_experts=num_experts, top_k=int(hf.num_experts_per_tok),
                      intermediate_size=int(hf.moe_intermediate_size),
                      renormalize=bool(hf.norm_topk_prob))
    cfg.moe_layers = sparse_layers(hf, cfg.num_layers, num_experts)
    return cfg


def sparse_layers(hf, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Which layers route to experts: transformers' rule (Qwen3MoeDecoderLayer, and
    Qwen2MoeDecoderLayer's, the same): not in mlp_only_layers, every
    decoder_sparse_step-th layer."""
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                 for i in range(num_layers))


def load_weights(model_dir, cfg, dtype, device, shard=None, matmul_dtype=None,
                 slices=CheckpointSlices):
    return torch_decoder.load_weights(model_dir, cfg, dtype, device, shard, matmul_dtype,
                                      PACKED_MODULES_MAPPING, slices)


Model = torch_decoder.TorchDecoder
