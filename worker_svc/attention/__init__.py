"""Paged attention: the KV cache layout, the per-step metadata, and the backends
(a torch path for CPU, Triton kernels for CUDA) that read the cache in place.

Every backend implements the same two calls:

    write_kv(key, value, kv_cache, slot_mapping) -> None
    attention(query, kv_cache, meta, scale) -> out

`kv_cache` of one layer is a tensor [2, num_blocks, block_size, num_kv_heads,
head_dim]: kv_cache[0] holds keys, kv_cache[1] values. A token's slot is
block_id * block_size + offset_in_block. Block 0 is the reserved null block.
`key`/`value` are [num_tokens, num_kv_heads, head_dim]; `query` and `out` are
[num_tokens, num_heads, head_dim] with num_heads a multiple of num_kv_heads (GQA).
The query rows of request i are query_start_loc[i]:query_start_loc[i+1]; they are
the LAST q_len positions of its context of seq_lens[i] tokens (cached context plus
this step's tokens), attended causally.
"""

from worker_svc.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
