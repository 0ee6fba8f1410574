"""Paged-attention batches for the kernel tests: scattered block tables, every
cache slot outside a request's context poisoned with NaN (a kernel that reads a
slot it should not turns its output NaN), and an fp32 ground truth."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.attention.reference import reference_attention

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass(slots=True)
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, page, num_kv_heads, head_dim]
    meta: AttentionMetadata
    scale: float
    window: int | None = None  # a sliding window, as the kernels take it
    softcap: float | None = None  # capped scores (Gemma 2)

    def expected(self) -> torch.Tensor:
        """The reference in fp32 on the same (already rounded) inputs."""
        return reference_attention(self.query.float(), self.kv_cache.float(), self.meta,
                                   self.scale, self.window, self.softcap)

    def kernel_args(self):
        m = self.meta
        return (self.query, self.kv_cache[0], self.kv_cache[1], m.block_table, m.seq_lens,
                m.query_start_loc)


def make_batch(q_lens: list[int], seq_lens: list[int], *, num_heads: int = 9,
               num_kv_heads: int = 3, head_dim: int = 64, page: int = 16,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // page) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks stay NaN, like block 0
    kv_cache = torch.full((2, num_blocks, page, num_kv_heads, head_dim), float("nan"))
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req + [1]), dtype=torch.int32)
    for i, s in enumerate(seq_lens):
        table = [free.pop() for _ in range(blocks_per_req[i])]
        block_table[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        for pos in range(s):
            b, off = table[pos // page], pos % page
            kv_cache[:, b, off] = torch.randn(2, num_kv_heads, head_dim, generator=g)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64),  # unused here
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return Batch(query.to(dtype), kv_cache.to(dtype), meta, head_dim ** -0.5)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def assert_matches(got: torch.Tensor, batch: Batch) -> None:
    """Every element written (no NaN left) and max error / max |ref| within tolerance."""
    want = batch.expected()
    assert got.dtype == batch.query.dtype and got.shape == want.shape
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} elements unwritten/NaN"
    rel = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert rel < TOLERANCE[got.dtype], f"relative error {rel:.2e} for {got.dtype}"


def free_behind_window(batch: Batch, window: int, seed: int = 0) -> int:
    """The block table as the scheduler leaves it for a sliding-window model
    (docs/scheduling.md, freeing behind the window): each request's entries wholly
    before its first query row's window point at the null block 0, which holds finite
    garbage here, as a reused block holds another request's KV: a kernel that reads
    such an entry unmasked gets a wrong answer; one that skips it, or masks it, the
    right one. Returns how many entries were freed."""
    g = torch.Generator().manual_seed(seed)
    garbage = torch.randn(batch.kv_cache[:, 0].shape, generator=g) * 100
    batch.kv_cache[:, 0] = garbage.to(batch.kv_cache.dtype)
    page = batch.kv_cache.shape[2]
    m, freed = batch.meta, 0
    for i in range(len(m.seq_lens)):
        q = int(m.query_start_loc[i + 1] - m.query_start_loc[i])
        first = int(m.seq_lens[i]) - q  # the first query row's position
        for b in range(m.block_table.shape[1]):
            if (b + 1) * page - 1 < first - window + 1 and m.block_table[i, b] != 0:
                m.block_table[i, b] = 0
                freed += 1
    return freed
