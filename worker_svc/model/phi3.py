"""Phi-3, Phi-3.5 and Phi-4-mini: Llama's layer on the torch path (torch_decoder.py),
with q/k/v and gate/up fused in the checkpoint itself (weights.causal_lm_entries
enters qkv_proj and gate_up_proj as their parts), `longrope` scaling and, on
Phi-4-mini, RoPE on part of each head (partial_rotary_factor: ModelConfig.rotary_dim).

longrope rotates with short_factor while a sequence fits the pretraining length and
with long_factor past it. transformers picks the set per forward call from the call's
longest position (a call reaching past original_max_position_embeddings rotates all
its tokens with the long set): its one-call prefill of a longer prompt rotates every
token long, a shorter prompt's tokens below the length stay short. We compute that per
request and position, whatever the chunking (layers.longrope_rows; docs/models.md).
"""

from __future__ import annotations

from worker_svc.model import torch_decoder
from worker_svc.model.loading.weights import CheckpointSlices
from worker_svc.model.config import ModelConfig, require_silu

PACKED_MODULES_MAPPING = torch_decoder.LLAMA_NAMES


def configure(hf, cfg: ModelConfig) -> ModelConfig:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    require_silu(hf)
    rope = hf.rope_parameters
    if rope.get("rope_type") == "longrope":
        original = int(rope["original_max_position_embeddings"])
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=original + 1)
        cfg.long_inv_freq, cfg.long_from = long_inv_freq.float(), original
    cfg.qkv_bias = bool(getattr(hf, "attention_bias", False))
    if getattr(hf, "sliding_window", None):
        cfg.sliding_window = int(hf.sliding_window)
    return cfg


def load_weights(model_dir, cfg, dtype, device, shard=None, matmul_dtype=None,
                 slices=CheckpointSlices):
    return torch_decoder.load_weights(model_dir, cfg, dtype, device, shard, matmul_dtype,
                                      PACKED_MODULES_MAPPING, slices)


Model = torch_decoder.TorchDecoder
