"""Chunked-prefill attention: several query tokens per request, flattened and
ragged, attending causally over the request's cached context plus its new tokens
(whose KV the layer has already written to the cache).

One program per (request, tile of BLOCK_Q query tokens, KV head). Its BLOCK_M rows
are the BLOCK_Q tokens times the GROUP query heads that share the KV head, so one
load of each K/V tile serves the whole group (GQA/MQA) and tl.dot gets >= 16 rows
even for a single token. Tiles past a request's query length exit at once, which
lets the grid be sized from max_query_len with no device-to-host sync. A sliding
window skips the tiles before the window of the tile's first query and masks keys a
window or more behind each row; soft-capped scores (Gemma 2) pass through
cap * tanh(score / cap) before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_svc.kernels.common import (LOG2E, NO_WINDOW, block_d, check_dtype,
                                       dot_settings, output_for, paged_offsets, soft_cap)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr,
                    out_ptr, qk_scale, window, softcap,
                    stride_q_tok, stride_q_head,
                    stride_c_block, stride_c_slot, stride_c_head,
                    stride_bt_req, stride_o_tok, stride_o_head,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAGE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    CAPPED: tl.constexpr):
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_tok = q_tile * BLOCK_Q + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    mask_m = (r < BLOCK_Q * GROUP) & (q_tok < q_len)
    mask_d = d < HEAD_DIM
    # absolute position of each row; padding rows borrow the last real one so every
    # row sees key 0 and its softmax stays finite (they are never stored)
    q_pos = context_len + tl.minimum(q_tok, q_len - 1)
    rows = (q_start + q_tok).to(tl.int64)
    q_off = rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    head_off = kv_head * stride_c_head
    # keys past the tile's last query position are masked for every row: skip them
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    # keys before the window of the tile's first query are masked for every row too
    kv_start = tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in range(kv_start // BLOCK_N, tl.cdiv(kv_end, BLOCK_N)):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = pos < kv_end
        tok_off = paged_offsets(bt_row, pos, mask_n, stride_c_block, stride_c_slot, PAGE)
        tok_off += head_off
        k_t = tl.load(k_cache_ptr + tok_off[None, :] + d[:, None],
                      mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_cache_ptr + tok_off[:, None] + d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
        if CAPPED:
            s = soft_cap(s, softcap)
        visible = mask_n[None, :] & (pos[None, :] <= q_pos[:, None]) \
            & (q_pos[:, None] - pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a window can hide a whole tile from a row that sees later keys: keep it finite
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o_off = rows[:, None] * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(out_ptr + o_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


LAUNCH = dict(num_warps=4, num_stages=2)


def prefill_constexprs(group: int, head_dim: int, page: int, block_m: int, block_n: int,
                       dtype: torch.dtype, device: torch.device, capped: bool = False) -> dict:
    """The kernel's compile-time arguments (also used by the offline GPU compile check)."""
    upcast, precision = dot_settings(dtype, device)
    block_m = max(block_m, triton.next_power_of_2(group))  # at least one token per tile
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_m // group,
                BLOCK_D=block_d(head_dim), BLOCK_N=block_n, PAGE=page, UPCAST=upcast,
                PRECISION=precision, CAPPED=capped)


def paged_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                  block_m: int = 64, block_n: int = 64,
                  out: torch.Tensor | None = None, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] flattened over requests
    (query_start_loc); k_cache/v_cache [num_blocks, page, num_kv_heads, head_dim].
    window: each query sees its last `window` keys; softcap: scores capped by tanh."""
    check_dtype(query, "query")
    num_heads, head_dim = query.shape[1], query.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")
    num_reqs = seq_lens.shape[0]
    out = output_for(query, out)
    if num_reqs == 0 or max_query_len == 0:
        return out
    consts = prefill_constexprs(group, head_dim, page, block_m, block_n, query.dtype,
                                query.device, softcap is not None)
    grid = (num_reqs, triton.cdiv(max_query_len, consts["BLOCK_Q"]), num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, scale * LOG2E,
        window or NO_WINDOW, (softcap or 1.0) * LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1), **consts, **LAUNCH)
    return out
