"""Mixtral: Mistral's attention and, in every layer, routed experts (layers.moe):
softmax over the experts, top-k, the top-k probabilities always renormalised. Its
checkpoints name an expert's gate, down and up projections w1, w2 and w3."""

from __future__ import annotations

from worker_svc.model import torch_decoder
from worker_svc.model.loading.weights import CheckpointSlices
from worker_svc.model.config import ModelConfig, require_silu
from worker_svc.model.layers import MoeSpec

PACKED_MODULES_MAPPING = {**torch_decoder.LLAMA_NAMES,
                          "router": ("block_sparse_moe.gate",),
                          "expert_gate_up": ("block_sparse_moe.experts.{e}.w1",
                                             "block_sparse_moe.experts.{e}.w3"),
                          "expert_down": ("block_sparse_moe.experts.{e}.w2",)}


def configure(hf, cfg: ModelConfig) -> ModelConfig:
    require_silu(hf)
    if getattr(hf, "sliding_window", None):  # applied past it (config.layer_windows)
        cfg.sliding_window = int(hf.sliding_window)
    cfg.moe = MoeSpec(num_experts=int(hf.num_local_experts), top_k=int(hf.num_experts_per_tok),
                      intermediate_size=int(hf.intermediate_size), renormalize=True)
    cfg.moe_layers = (True,) * cfg.num_layers
    return cfg


def load_weights(model_dir, cfg, dtype, device, shard=None, matmul_dtype=None,
                 slices=CheckpointSlices):
    return torch_decoder.load_weights(model_dir, cfg, dtype, device, shard, matmul_dtype,
                                      PACKED_MODULES_MAPPING, slices)


Model = torch_decoder.TorchDecoder
