"""Attention backend for CUDA workers: Triton kernels that read the paged KV cache
in place (worker_svc/kernels). Same two calls as every backend; see __init__.py."""

from __future__ import annotations

import functools

import torch

from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.kernels import kv_write
from worker_svc.kernels.decode import choose_num_splits, paged_decode
from worker_svc.kernels.prefill import paged_prefill

# the interpreter (CPU tests) has no SMs; a mid-size GPU's count keeps split-K exercised
_DEFAULT_NUM_SMS = 64


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kv_write.write_kv(key, value, kv_cache, slot_mapping)


def attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> out of the same shape and dtype.
    Rows outside every request's query range are left unwritten. window: each query
    sees its last `window` keys (None: all); softcap: scores capped by tanh."""
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"query {tuple(query.shape)} must be [tokens, heads, head_dim] and "
                         f"kv_cache {tuple(kv_cache.shape)} [2, blocks, block_size, kv_heads, "
                         "head_dim]")
    if query.shape[2] != kv_cache.shape[4] or query.dtype != kv_cache.dtype:
        raise ValueError(f"query {tuple(query.shape)} {query.dtype} does not match kv_cache "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
    if query.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("query and kv_cache need a contiguous last (head_dim) axis")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    common = (query, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.query_start_loc)
    if meta.max_query_len <= 1:
        splits = choose_num_splits(meta.num_reqs, kv_cache.shape[3], meta.max_seq_len,
                                   _num_sms(query.device))
        return paged_decode(*common, scale, num_splits=splits, window=window,
                            softcap=softcap)
    return paged_prefill(*common, meta.max_query_len, scale, window=window, softcap=softcap)
