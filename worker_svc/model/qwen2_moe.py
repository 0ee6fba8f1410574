"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v bias under qkv_bias, no q/k norm)
and, in the layers the config makes sparse (transformers' rule, as Qwen3-MoE's:
mlp_only_layers and decoder_sparse_step), routed experts (layers.moe: softmax over the
experts, top-k, renormalised only under norm_topk_prob) plus a shared expert every
token passes, scaled by sigmoid(shared_expert_gate) and added. With
use_sliding_window the layers its layer_types marks sliding attend within the window."""

from __future__ import annotations

from worker_svc.model import torch_decoder
from worker_svc.model.loading.weights import CheckpointSlices
from worker_svc.model.config import ModelConfig, require_silu
from worker_svc.model.layers import MoeSpec
from worker_svc.model.qwen3 import sliding_layers
from worker_svc.model.qwen3_moe import PACKED_MODULES_MAPPING as QWEN3_MOE_NAMES, sparse_layers

PACKED_MODULES_MAPPING = {**{k: v for k, v in QWEN3_MOE_NAMES.items()
                             if k not in ("q_norm", "k_norm")},
                          "shared_gate_up": ("mlp.shared_expert.gate_proj",
                                             "mlp.shared_expert.up_proj"),
                          "shared_down": ("mlp.shared_expert.down_proj",),
                          "shared_gate": ("mlp.shared_expert_gate",)}


def configure(hf, cfg: ModelConfig) -> ModelConfig:
    require_silu(hf)
    sliding_layers(hf, cfg)
    cfg.qkv_bias = bool(getattr(hf, "qkv_bias", True))
    num_experts = int(hf.num_experts)
    cfg.moe = MoeSpec(num_experts=num_experts, top_k=int(hf.num_experts_per_tok),
                      intermediate_size=int(hf.moe_intermediate_size),
                      renormalize=bool(hf.norm_topk_prob),
                      shared_intermediate_size=int(hf.shared_expert_intermediate_size or 0))
    cfg.moe_layers = sparse_layers(hf, cfg.num_layers, num_experts)
    return cfg


def load_weights(model_dir, cfg, dtype, device, shard=None, matmul_dtype=None,
                 slices=CheckpointSlices):
    return torch_decoder.load_weights(model_dir, cfg, dtype, device, shard, matmul_dtype,
                                      PACKED_MODULES_MAPPING, slices)


Model = torch_decoder.TorchDecoder
