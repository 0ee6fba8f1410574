"""Reference paged attention: one request at a time, gather + causal softmax in
float32. Slow and obviously correct; the ground truth for every backend's tests."""

from __future__ import annotations

import torch

from worker_svc.attention.metadata import AttentionMetadata


def reference_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> out of the same shape and dtype.
    window: a query at position p sees keys at p - window + 1 .. p (transformers'
    sliding window); softcap: scores become softcap * tanh(scores / softcap)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_table[i, :num_blocks].long()
        # [seq_len, num_kv_heads, head_dim], the request's context in token order
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        # query j sits at absolute position seq_len - q_len + j and sees keys up to it
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= q_pos - k_pos >= window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
