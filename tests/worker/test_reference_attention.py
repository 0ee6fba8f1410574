"""The reference attention equals plain causal attention over contiguous K/V."""

import torch

from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.attention.reference import reference_attention


def _dense_causal(q, k, v, scale):
    # q [q_len, H, D], k/v [S, H, D]; queries are the last q_len positions
    q_len, seq_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_reference_matches_dense_causal_attention_with_gqa_and_scattered_blocks():
    torch.manual_seed(0)
    block_size, num_kv_heads, group, head_dim = 4, 2, 3, 8
    num_heads = num_kv_heads * group
    kv_cache = torch.randn(2, 32, block_size, num_kv_heads, head_dim)
    # request 0: 10 context tokens, last 3 are queries; request 1: a 1-token decode
    seq_lens, q_lens = [10, 7], [3, 1]
    tables = [[5, 17, 2], [30, 9]]
    block_table = torch.zeros(2, 3, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, :len(t)] = torch.tensor(t)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, max_query_len=3, max_seq_len=10)
    query = torch.randn(4, num_heads, head_dim)
    out = reference_attention(query, kv_cache, meta, 0.3)
    starts = [0, 3, 4]
    for i, t in enumerate(tables):
        k = kv_cache[0, t].reshape(-1, num_kv_heads, head_dim)[:seq_lens[i]]
        v = kv_cache[1, t].reshape(-1, num_kv_heads, head_dim)[:seq_lens[i]]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        want = _dense_causal(query[starts[i]:starts[i + 1]], k, v, 0.3)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want)
