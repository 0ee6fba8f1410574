"""KV-cache write: each new token's keys and values go to its slot in the paged
cache; a slot of -1 marks a padding token and is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_svc.kernels.common import check_dtype


@triton.jit
def _kv_write_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_c_block, stride_c_slot, stride_c_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    tok64 = tok.to(tl.int64)
    src_k = tok64 * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    src_v = tok64 * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    dst = ((slot // PAGE) * stride_c_block + (slot % PAGE) * stride_c_slot
           + heads[:, None] * stride_c_head + dims[None, :])
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def kv_write_constexprs(num_kv_heads: int, head_dim: int, page: int) -> dict:
    return dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                BLOCK_H=triton.next_power_of_2(num_kv_heads),
                BLOCK_D=triton.next_power_of_2(head_dim), PAGE=page)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> kv_cache[0/1] at slot_mapping."""
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                         "equal [num_tokens, num_kv_heads, head_dim]")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match key "
                         f"{tuple(key.shape)}: expected [2, blocks, block_size, "
                         f"{key.shape[1]}, {key.shape[2]}]")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must have one slot per "
                         f"token ({key.shape[0]})")
    check_dtype(kv_cache, "kv_cache")
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} must match the cache's "
                         f"{kv_cache.dtype}")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("key, value and kv_cache need a contiguous last (head_dim) axis")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _kv_write_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **kv_write_constexprs(num_kv_heads, head_dim, kv_cache.shape[2]), num_warps=4)
