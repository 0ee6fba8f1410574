"""Chunked-prefill attention (ragged query chunks, causal over cached context plus
new tokens, read from the paged cache) matches the fp32 reference and writes
every output element."""

import pytest
import torch

from tests.kernels.cases import assert_matches, free_behind_window, make_batch, poisoned_like
from worker_svc.kernels.prefill import paged_prefill


def run(batch, **kw):
    out = poisoned_like(batch.query)
    got = paged_prefill(*batch.kernel_args(), batch.meta.max_query_len, batch.scale,
                        out=out, **kw)
    assert got is out
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_prefill_and_decode_batch_matches_reference(dtype):
    # fresh prompt, chunk after cached context ending on a block edge, decodes of
    # 1 token and just past a block edge, a chunk spanning several blocks
    q_lens = [13, 6, 1, 1, 20]
    seq_lens = [13, 22, 1, 17, 50]
    batch = make_batch(q_lens, seq_lens, dtype=dtype)
    assert_matches(run(batch, block_m=32, block_n=16), batch)


def test_query_chunk_longer_than_one_query_tile():
    # group 3 with 16-row tiles holds 5 tokens: 12 tokens take 3 tiles, the last partial
    batch = make_batch([12, 4], [12, 21], seed=1)
    assert_matches(run(batch, block_m=16, block_n=16), batch)


def test_prefill_mqa_and_chunk_ending_exactly_on_block_edge():
    batch = make_batch([8, 16, 1], [16, 32, 9], num_heads=4, num_kv_heads=1, head_dim=32,
                       page=8, seed=2)
    assert_matches(run(batch, block_m=64, block_n=32), batch)


def test_prefill_tile_wider_than_page_and_head_dim_masked():
    batch = make_batch([7, 3], [30, 3], num_heads=2, num_kv_heads=2, head_dim=40, page=4,
                       seed=3)
    assert_matches(run(batch, block_m=16, block_n=64), batch)


def test_bad_tile_sizes_are_rejected():
    batch = make_batch([2], [4])
    with pytest.raises(ValueError, match="power of two"):
        paged_prefill(*batch.kernel_args(), 2, batch.scale, block_m=8)


def test_query_may_be_a_strided_view_and_out_is_contiguous():
    batch = make_batch([4, 1], [9, 5], seed=4)
    want = batch.expected()
    wide = torch.cat([batch.query, torch.full_like(batch.query, float("nan"))], dim=2)
    batch.query = wide[:, :, :64]  # every row strided past its NaN twin
    got = paged_prefill(*batch.kernel_args(), batch.meta.max_query_len, batch.scale)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 33, 1000])
def test_prefill_with_sliding_window_hides_keys_a_window_behind_each_row(window):
    # chunks after context, a fresh prompt longer than the window, decodes
    batch = make_batch([13, 6, 1, 1, 20], [13, 22, 1, 17, 50], seed=7)
    batch.window = window
    assert_matches(run(batch, block_m=32, block_n=16, window=window), batch)


@pytest.mark.parametrize("window", [None, 9])
def test_prefill_with_soft_capped_scores_matches_reference(window):
    batch = make_batch([13, 6, 1, 20], [13, 22, 17, 50], seed=8)
    batch.query = batch.query * 4
    batch.window, batch.softcap = window, 1.5
    assert_matches(run(batch, block_m=32, block_n=16, window=window, softcap=1.5), batch)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_prefill_never_reads_an_entry_freed_behind_the_window(window):
    """Chunks after context and decodes whose blocks behind the first row's window
    were freed (the null block, holding another request's KV by then): exact."""
    batch = make_batch([6, 1, 1, 20], [40, 17, 50, 50], seed=10)
    batch.window = window
    want = batch.expected()
    assert free_behind_window(batch, window) > 0
    torch.testing.assert_close(batch.expected(), want)
    assert_matches(run(batch, block_m=32, block_n=16, window=window), batch)
