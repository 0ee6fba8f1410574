"""Attention backend for CPU (and any device without Triton).

Decodes (one query token) of all requests run in ONE call: the C paged-decode kernel
(cpu_kernel.py) on fp32 CPU tensors when the compute plan gives it (TorchBackend's
decode_kernel), which reads K/V in place; otherwise a batched
SDPA over the block-gathered contexts, padded to the longest and masked. Prefill
chunks (several query tokens) run one SDPA each: a step holds few of them, and
padding a long chunk to the batch would cost far more than the loop. The per-step
plan (which rows are decodes, gather indices, masks) is built once and reused by
every layer.

Layers with a sliding window (Mistral, Gemma's local layers) past that window, and
attention-score soft-capping (Gemma 2), take their own per-step plan: masks that
also hide keys a window or more behind the query, batched SDPA for the decodes
(the C kernel has no window), and the reference's math where scores are capped,
which SDPA cannot do. A windowed plan gathers only the blocks from the one holding
the first key its earliest query sees: the blocks before it may have been freed and
handed to another request (the scheduler frees blocks behind a window when every
layer has one, shared/kv_window.py), and are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import ctypes

import torch
import torch.nn.functional as F

from worker_svc.attention import cpu_kernel
from worker_svc.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _Prefill:
    rows: slice  # this request's query rows
    blocks: torch.Tensor  # [num_blocks] int64: from the first its window reaches
    seq_len: int  # keys in those blocks up to the chunk's end
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None = plain causal (no context)


@dataclass(slots=True)
class _Plan:
    decode_rows: torch.Tensor | None  # [num_decodes] int64 query rows
    decode_blocks: torch.Tensor | None  # [num_decodes * max_blocks] int64, row-major
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    decode_len: int  # keys per decode after gathering (the one decode's exact length)
    decode_kernel: cpu_kernel.PagedDecode | None  # the C kernel's call for this step
    decode_all_rows: bool  # every query row is a decode, in order: no gather/scatter
    prefills: list[_Prefill]


# every layer of a step passes the same slot_mapping: look for padding (-1) once
_checked_slots: list = [None, None]  # [slot_mapping seen last, its rows to keep or None]


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    if _checked_slots[0] is not slot_mapping:
        padded = slot_mapping.numel() > 0 and bool((slot_mapping < 0).any())
        _checked_slots[:] = [slot_mapping, (slot_mapping >= 0) if padded else None]
    keep = _checked_slots[1]
    if keep is not None:
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_flat.index_copy_(0, slot_mapping, key)
    v_flat.index_copy_(0, slot_mapping, value)


class TorchBackend:
    """This module's backend with the compute plan's choice bound: decode_kernel is
    the C kernel's library (cpu_kernel.load()), or None for batched SDPA."""

    def __init__(self, decode_kernel: ctypes.CDLL | None) -> None:
        self.decode_kernel = decode_kernel

    write_kv = staticmethod(write_kv)

    def attention(self, query: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        return attention(query, kv_cache, meta, scale, self.decode_kernel, window, softcap)

    def decode_kernel_plan(self, meta: AttentionMetadata, num_heads: int,
                           kv_cache: torch.Tensor, scale: float):
        return decode_kernel_plan(meta, num_heads, kv_cache, scale, self.decode_kernel)


def attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, decode_kernel: ctypes.CDLL | None = None,
              window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> out of the same shape and dtype;
    decode_kernel: the C kernel's library, None for the torch path; window: keys at
    most window - 1 positions behind each query (None: all); softcap: scores capped
    at +-softcap by tanh (None: not capped)."""
    if window is not None or softcap is not None:
        plan = _torch_plan(meta, query, kv_cache, window)
    else:
        plan = meta.backend_state
        if not isinstance(plan, _Plan):
            plan = meta.backend_state = _make_plan(meta, query, kv_cache, scale,
                                                   decode_kernel)
    if softcap is not None:
        return _capped(query, kv_cache, plan, scale, softcap)
    gqa = query.shape[1] != kv_cache.shape[3]
    if plan.decode_all_rows and not plan.prefills and plan.decode_kernel is None:
        return _decode(query, kv_cache, plan, scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if plan.decode_kernel is not None:
        plan.decode_kernel(query, kv_cache, out)
    elif plan.decode_rows is not None:
        out[plan.decode_rows] = _decode(query[plan.decode_rows], kv_cache, plan, scale)
    for p in plan.prefills:
        k = kv_cache[0].index_select(0, p.blocks).flatten(0, 1)[:p.seq_len].transpose(0, 1)
        v = kv_cache[1].index_select(0, p.blocks).flatten(0, 1)[:p.seq_len].transpose(0, 1)
        q = query[p.rows].transpose(0, 1)  # [heads, q_len, head_dim]
        # 4-D inputs: with 3-D ones SDPA takes its math path, ~10x slower at 2k tokens
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=p.mask,
                                           is_causal=p.mask is None, scale=scale,
                                           enable_gqa=gqa)
        out[p.rows] = o[0].transpose(0, 1)
    return out


def decode_kernel_plan(meta: AttentionMetadata, num_heads: int, kv_cache: torch.Tensor,
                       scale: float, decode_kernel: ctypes.CDLL | None = None):
    """The step's C decode kernel (cpu_kernel.PagedDecode) when it serves every row of
    the step (each a single-token decode), else None; the plan is the one attention()
    uses for this step, made here if no layer made it yet."""
    plan = meta.backend_state
    if not isinstance(plan, _Plan):
        probe = torch.empty(0, num_heads, kv_cache.shape[4], dtype=kv_cache.dtype,
                            device=kv_cache.device)  # attention()'s query, for its shape
        plan = meta.backend_state = _make_plan(meta, probe, kv_cache, scale, decode_kernel)
    if plan.decode_kernel is None or not plan.decode_all_rows or plan.prefills:
        return None
    return plan.decode_kernel


def _decode(query: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan,
            scale: float) -> torch.Tensor:
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    # index_select copies whole blocks (contiguous rows): far faster than advanced indexing
    k = kv_cache[0].index_select(0, plan.decode_blocks).view(num_decodes, -1, num_kv_heads,
                                                              head_dim)[:, :plan.decode_len]
    v = kv_cache[1].index_select(0, plan.decode_blocks).view(num_decodes, -1, num_kv_heads,
                                                              head_dim)[:, :plan.decode_len]
    # GQA: the query heads sharing a KV head become that head's query rows
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=plan.decode_mask, scale=scale)
    return o.reshape(num_decodes, num_heads, head_dim)


def _torch_plan(meta: AttentionMetadata, query: torch.Tensor, kv_cache: torch.Tensor,
                window: int | None) -> _Plan:
    """The step's plan without the C kernel for layers with this sliding window (or
    none, for capped scores), made by the first of them."""
    if meta.windowed_states is None:
        meta.windowed_states = {}
    plan = meta.windowed_states.get(window)
    if plan is None:
        plan = meta.windowed_states[window] = _make_plan(meta, query, kv_cache, 1.0, None,
                                                         window)
    return plan


def _capped(query: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan, scale: float,
            softcap: float) -> torch.Tensor:
    """Attention with scores soft-capped (Gemma 2), in transformers' eager order:
    scale, cap, mask, softmax in fp32. Every row through the plan's masks."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    group = query.shape[1] // kv_cache.shape[3]
    if plan.decode_rows is not None:
        n, max_len = plan.decode_rows.shape[0], plan.decode_len
        k = kv_cache[0].index_select(0, plan.decode_blocks).view(n, -1, *kv_cache.shape[3:])
        v = kv_cache[1].index_select(0, plan.decode_blocks).view(n, -1, *kv_cache.shape[3:])
        mask = plan.decode_mask
        if mask is None:  # a lone decode sees all its keys
            mask = torch.ones(n, 1, 1, max_len, dtype=torch.bool, device=query.device)
        q = query[plan.decode_rows].unsqueeze(2)  # [n, heads, 1, head_dim]
        o = _capped_sdpa(q, k[:, :max_len].transpose(1, 2), v[:, :max_len].transpose(1, 2),
                         mask, scale, softcap, group)
        out[plan.decode_rows] = o[:, :, 0]
    for p in plan.prefills:
        k = kv_cache[0].index_select(0, p.blocks).flatten(0, 1)[:p.seq_len].transpose(0, 1)
        v = kv_cache[1].index_select(0, p.blocks).flatten(0, 1)[:p.seq_len].transpose(0, 1)
        q = query[p.rows].transpose(0, 1)
        mask = p.mask
        if mask is None:
            mask = torch.ones(q.shape[1], p.seq_len, dtype=torch.bool,
                              device=query.device).tril()
        out[p.rows] = _capped_sdpa(q[None], k[None], v[None], mask, scale, softcap,
                                   group)[0].transpose(0, 1)
    return out


def _capped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float, softcap: float, group: int) -> torch.Tensor:
    """q [b, heads, q_len, d], k/v [b, kv_heads, k_len, d], mask broadcast to scores."""
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _make_plan(meta: AttentionMetadata, query: torch.Tensor, kv_cache: torch.Tensor,
               scale: float, decode_kernel: ctypes.CDLL | None,
               window: int | None = None) -> _Plan:
    block_size, device = kv_cache.shape[2], query.device
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(seq_lens))]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    prefills = []
    for i, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        seq_len = seq_lens[i]
        num_blocks = -(-seq_len // block_size)
        mask = None
        windowed = window is not None and seq_len > window  # else the window hides nothing
        # the block of the first key the chunk's first query sees
        first = max(0, seq_len - q_len - window + 1) // block_size if windowed else 0
        if seq_len != q_len or windowed:  # cached context before the chunk, or a window
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
            k_pos = torch.arange(first * block_size, seq_len, device=device).unsqueeze(0)
            mask = k_pos <= q_pos
            if windowed:
                mask &= q_pos - k_pos < window
        prefills.append(_Prefill(rows=slice(starts[i], starts[i + 1]),
                                 blocks=meta.block_table[i, first:num_blocks].long(),
                                 seq_len=seq_len - first * block_size, mask=mask))
    if not decodes:
        return _Plan(None, None, None, 0, None, False, prefills)
    idx = torch.tensor(decodes, device=device)
    max_len = max(seq_lens[i] for i in decodes)
    max_blocks = -(-max_len // block_size)
    rows = torch.tensor([starts[i] for i in decodes], device=device)
    if window is not None and max_len > window:
        return _windowed_decodes(meta, idx, rows, decodes, max_blocks, block_size, window,
                                 len(decodes) == starts[-1]
                                 and decodes == list(range(len(seq_lens))), prefills)
    table = meta.block_table[idx, :max_blocks].long().contiguous()
    all_rows = len(decodes) == starts[-1] and decodes == list(range(len(seq_lens)))
    # the plan chose the kernel for fp32 CPU; supports() only guards the tensors' layout
    lib = decode_kernel if window is None and cpu_kernel.supports(query, kv_cache) else None
    if lib is not None:  # every layer has the same scale and cache layout: fix them now
        kernel = cpu_kernel.paged_decode_for_step(lib, query.shape[1], kv_cache.shape, table,
                                                  meta.seq_lens[idx], rows, max_len, scale)
        return _Plan(rows, None, None, max_len, kernel, all_rows, prefills)
    mask = None  # a lone decode attends to exactly its keys: no mask, no padding
    if len(decodes) > 1 or (window is not None and max_len > window):
        key_pos = torch.arange(max_len, device=device).unsqueeze(0)
        lens = meta.seq_lens[idx].long().unsqueeze(1)
        mask = key_pos < lens
        if window is not None:  # the decode sits at lens - 1
            mask &= key_pos >= lens - window
        mask = mask.view(len(decodes), 1, 1, -1)
    return _Plan(rows, table.reshape(-1), mask, max_len, None, all_rows, prefills)


def _windowed_decodes(meta: AttentionMetadata, idx: torch.Tensor, rows: torch.Tensor,
                      decodes: list[int], max_blocks: int, block_size: int, window: int,
                      all_rows: bool, prefills: list[_Prefill]) -> _Plan:
    """Decodes of a windowed layer: each row gathers the same number of blocks, from
    the one holding its first key in the window (the query at len - 1 sees len - window
    on), so no row reads a block its window left behind; keys past a row's end (its
    table's zero padding, the null block) and before its window are masked."""
    device = idx.device
    lens = meta.seq_lens[idx].long()
    first = (lens - window).clamp(min=0) // block_size  # [n]
    span = min(max_blocks, -(-(window + block_size - 1) // block_size))
    cols = first.unsqueeze(1) + torch.arange(span, device=device)  # [n, span]
    width = meta.block_table.shape[1]
    table = meta.block_table[idx].long().gather(1, cols.clamp(max=width - 1))
    key_pos = (first * block_size).unsqueeze(1) + torch.arange(span * block_size,
                                                               device=device)
    mask = (key_pos < lens.unsqueeze(1)) & (key_pos >= (lens - window).unsqueeze(1))
    return _Plan(rows, table.reshape(-1), mask.view(len(decodes), 1, 1, -1),
                 span * block_size, None, all_rows, prefills)
