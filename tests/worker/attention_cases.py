"""Random paged-attention cases shared by the backend tests: ragged requests with
scattered block tables, mixing decodes, first chunks and chunks after context."""

from __future__ import annotations

import torch

from worker_svc.attention.metadata import AttentionMetadata


def random_case(seed: int, q_lens: list[int], ctx_lens: list[int], block_size: int = 4,
                num_kv_heads: int = 2, group: int = 3, head_dim: int = 8,
                num_blocks: int = 64):
    """Returns (query, key, value, kv_cache, meta): key/value are this step's new
    tokens, not yet written; kv_cache already holds each request's context."""
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # never block 0
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    block_table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    slots = []
    for i, s in enumerate(seq_lens):
        n = -(-s // block_size)
        table = [perm.pop() for _ in range(n)]
        block_table[i, :n] = torch.tensor(table)
        for pos in range(ctx_lens[i], s):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=g)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return query, key, value, kv_cache, meta
