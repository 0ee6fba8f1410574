"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama layer (model/llama.py) with q/k/v and
gate/up fused in the checkpoint itself, `longrope` scaling and, on Phi-4-mini, RoPE
on part of each head (ModelConfig.rotary_dim).

longrope rotates with short_factor while a sequence fits the pretraining length and
with long_factor past it. transformers picks the set per forward call from the
call's longest position (a call reaching past original_max_position_embeddings
rotates all its tokens with the long set); here the set is picked per position
(position p takes the long set when p >= original_max_position_embeddings), which is
what transformers' own greedy loop does for every prompt within the pretraining
length and every generated token, and does not change with how a prompt is chunked.
"""

from __future__ import annotations

import torch

# the checkpoint's fused tensors, and the rows of each part (model/weights.py unfuses them)
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def part_rows(fused: str, cfg) -> list[int]:
    """How many rows of the fused tensor each part takes, in order."""
    if fused == "self_attn.qkv_proj":
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def long_rope(hf) -> tuple[torch.Tensor, int]:
    """(inverse frequencies with long_factor, the first position that takes them)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    original = int(hf.rope_parameters["original_max_position_embeddings"])
    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=original + 1)
    return inv_freq.float(), original
