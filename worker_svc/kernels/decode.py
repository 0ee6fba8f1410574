"""Paged decode attention: one query token per request.

One program per (request, KV head, split): it loads the group of query heads that
share the KV head (GQA/MQA), walks the request's context tile by tile through the
block table, and keeps an online softmax, so K/V are read from the cache exactly
once per KV head. With one split it writes the normalized output; with several
(split-K, for few long requests) each split writes a partial output and its
log-sum-exp, and a second kernel merges them. A sliding window (Mistral, Gemma's
local layers) starts the walk at the window's first key; soft-capped scores (Gemma 2)
pass through cap * tanh(score / cap) before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_svc.kernels.common import (LOG2E, NO_WINDOW, block_d, check_dtype,
                                       dot_settings, output_for, paged_offsets, soft_cap)

MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs its parallelism
MAX_SPLITS = 64
LAUNCH = dict(num_warps=4, num_stages=2)


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr,
                   out_ptr, part_out_ptr, part_lse_ptr, qk_scale, window, softcap,
                   stride_q_tok, stride_q_head,
                   stride_c_block, stride_c_slot, stride_c_head,
                   stride_bt_req, stride_o_tok, stride_o_head,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                   SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   CAPPED: tl.constexpr):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) == q_row:
        return  # a request with no query token this step
    seq_len = tl.load(seq_lens_ptr + req)
    first_key = tl.maximum(seq_len - window, 0)  # the query at seq_len - 1 sees window keys
    first_tile = first_key // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    num_splits = tl.num_programs(2)  # a runtime value: no recompile per split count
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, first_tile + num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    mask_g = g < GROUP
    mask_d = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_off = q_row.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    head_off = kv_head * stride_c_head
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = (pos < seq_len) & (pos >= first_key)
        tok_off = paged_offsets(bt_row, pos, mask_n, stride_c_block, stride_c_slot, PAGE)
        tok_off += head_off
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_t = tl.load(k_cache_ptr + tok_off[None, :] + d[:, None],
                      mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_cache_ptr + tok_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
        if CAPPED:
            s = soft_cap(s, softcap)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = mask_g[:, None] & mask_d[None, :]
    if not SPLIT:
        o_off = q_row.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        # partials: [num_reqs, num_heads, num_splits, BLOCK_D] and lse [.., num_splits]
        row = (req * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        safe_l = tl.where(l_i > 0, l_i, 1.0)  # an empty split: acc is 0, lse -inf
        tl.store(part_out_ptr + row[:, None].to(tl.int64) * BLOCK_D + d[None, :],
                 acc / safe_l[:, None], mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_g)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, qsl_ptr, out_ptr,
                         stride_o_tok, stride_o_head, num_splits, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) == q_row:
        return
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mask_s = s < num_splits
    row = (req * NUM_HEADS + head) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=mask_s, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    part = tl.load(part_out_ptr + row[:, None].to(tl.int64) * BLOCK_D + d[None, :],
                   mask=mask_s[:, None], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    o_off = q_row.to(tl.int64) * stride_o_tok + head * stride_o_head + d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int) -> int:
    """Split the context only when there are too few programs to fill the device
    and the contexts are long enough for each split to do real work."""
    programs = num_reqs * num_kv_heads
    if programs >= num_sms:
        return 1
    by_len = max_seq_len // MIN_TOKENS_PER_SPLIT
    by_device = triton.cdiv(2 * num_sms, programs)
    return max(1, min(by_len, by_device, MAX_SPLITS))


def decode_constexprs(group: int, head_dim: int, page: int, num_splits: int, block_n: int,
                      dtype: torch.dtype, device: torch.device, capped: bool = False) -> dict:
    """The decode kernel's compile-time arguments (also used by the offline GPU
    compile check, so it builds exactly what a launch would)."""
    upcast, precision = dot_settings(dtype, device)
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)),
                BLOCK_D=block_d(head_dim), BLOCK_N=block_n, PAGE=page, SPLIT=num_splits > 1,
                UPCAST=upcast, PRECISION=precision, CAPPED=capped)


def merge_constexprs(num_heads: int, head_dim: int, num_splits: int) -> dict:
    return dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
                BLOCK_S=triton.next_power_of_2(num_splits))


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, scale: float, num_splits: int = 1,
                 block_n: int = 64,
                 out: torch.Tensor | None = None, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim], one row per request (query_start_loc);
    k_cache/v_cache [num_blocks, page, num_kv_heads, head_dim]. Returns out like query.
    window: each query sees its last `window` keys; softcap: scores capped by tanh."""
    check_dtype(query, "query")
    num_heads, head_dim = query.shape[1], query.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if num_splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"need num_splits >= 1 and block_n a power of two >= 16, got "
                         f"{num_splits}, {block_n}")
    group = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    bd = block_d(head_dim)
    out = output_for(query, out)
    if num_reqs == 0:
        return out
    if num_splits > 1:
        part_out = torch.empty(num_reqs, num_heads, num_splits, bd, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32,
                               device=query.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        out, part_out, part_lse, scale * LOG2E, window or NO_WINDOW,
        (softcap or 1.0) * LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        **decode_constexprs(group, head_dim, page, num_splits, block_n, query.dtype,
                            query.device, softcap is not None), **LAUNCH)
    if num_splits > 1:
        _merge_splits_kernel[(num_reqs, num_heads)](
            part_out, part_lse, query_start_loc, out, out.stride(0), out.stride(1), num_splits,
            **merge_constexprs(num_heads, head_dim, num_splits), **LAUNCH)
    return out
