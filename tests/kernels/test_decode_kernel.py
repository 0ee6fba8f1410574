"""Paged decode attention (one query token per request) matches the fp32
reference and writes every output element, with and without split-K."""

import pytest
import torch

from tests.kernels.cases import assert_matches, free_behind_window, make_batch, poisoned_like
from worker_svc.kernels.decode import choose_num_splits, paged_decode

# seq lens with page 16: 1 token, exactly one block, just past it, several blocks
EDGE_LENS = [1, 16, 17, 50]


def run(batch, **kw):
    out = poisoned_like(batch.query)
    got = paged_decode(*batch.kernel_args(), batch.scale, out=out, **kw)
    assert got is out
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_gqa_9_over_3_matches_reference_at_block_edges(dtype):
    batch = make_batch([1] * 4, EDGE_LENS, dtype=dtype)
    assert_matches(run(batch, block_n=16), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode_merges_splits_including_empty_ones(dtype):
    # 3 splits of 16-token tiles: the 1- and 16-token requests leave splits empty
    batch = make_batch([1] * 4, EDGE_LENS, dtype=dtype, seed=1)
    assert_matches(run(batch, block_n=16, num_splits=3), batch)


def test_decode_mqa_one_kv_head_for_all_query_heads():
    batch = make_batch([1] * 3, [5, 33, 64], num_heads=4, num_kv_heads=1, head_dim=32,
                       page=8, seed=2)
    assert_matches(run(batch, block_n=32), batch)


def test_decode_head_dim_not_a_power_of_two_is_masked():
    batch = make_batch([1] * 2, [3, 20], num_heads=2, num_kv_heads=2, head_dim=40,
                       page=4, seed=3)
    assert_matches(run(batch, block_n=16), batch)


def test_decode_tile_larger_than_page_spans_several_blocks():
    # page 4 with 64-token tiles: one tile gathers from up to 16 scattered blocks
    batch = make_batch([1] * 2, [37, 64], page=4, seed=4)
    assert_matches(run(batch, block_n=64), batch)


def test_request_without_query_token_writes_nothing():
    batch = make_batch([1, 1], [9, 12], seed=5)
    batch.meta.query_start_loc = torch.tensor([0, 1, 1, 2], dtype=torch.int32)
    batch.meta.seq_lens = torch.tensor([9, 4, 12], dtype=torch.int32)
    batch.meta.block_table = torch.cat([batch.meta.block_table[:1], batch.meta.block_table])
    batch.meta.block_table[1] = 0  # padding request: the null block only
    assert_matches(run(batch, block_n=16), batch)


def test_split_k_only_when_few_programs_and_long_contexts():
    assert choose_num_splits(64, 8, 8192, num_sms=132) == 1  # 512 programs fill the device
    assert choose_num_splits(1, 8, 200, num_sms=132) == 1  # too short to split
    assert choose_num_splits(1, 8, 8192, num_sms=132) == 32  # 8k / 256 tokens per split
    assert choose_num_splits(4, 8, 8192, num_sms=132) == 9  # enough to reach 2 waves


def test_bad_shapes_are_rejected_before_launch():
    batch = make_batch([1], [4])
    with pytest.raises(ValueError, match="multiple"):
        paged_decode(batch.query[:, :4], *batch.kernel_args()[1:], batch.scale)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode(*batch.kernel_args(), batch.scale, block_n=24)
    with pytest.raises(ValueError, match="must match query"):
        paged_decode(*batch.kernel_args(), batch.scale, out=batch.query.half())


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])
def test_decode_with_sliding_window_sees_only_the_last_window_keys(window, num_splits):
    batch = make_batch([1] * 4, EDGE_LENS, seed=5)
    batch.window = window
    assert_matches(run(batch, block_n=16, num_splits=num_splits, window=window), batch)


@pytest.mark.parametrize("window", [None, 7])
def test_decode_with_soft_capped_scores_matches_reference(window):
    batch = make_batch([1] * 4, EDGE_LENS, seed=6)
    batch.query = batch.query * 4  # scores past the cap
    batch.window, batch.softcap = window, 1.5
    assert_matches(run(batch, block_n=16, window=window, softcap=1.5), batch)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 7, 16])
def test_decode_never_reads_an_entry_freed_behind_the_window(window, num_splits):
    """Blocks behind every layer's window are freed while a request runs (the entry
    points at the null block, soon another request's): the answer stays exact."""
    batch = make_batch([1] * 4, EDGE_LENS, seed=9)
    batch.window = window
    want = batch.expected()
    assert free_behind_window(batch, window) > 0
    torch.testing.assert_close(batch.expected(), want)  # the reference masks them too
    assert_matches(run(batch, block_n=16, num_splits=num_splits, window=window), batch)
