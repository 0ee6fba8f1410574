"""The Triton backend behind the common interface: write this step's K/V through
the slot mapping, then attend; decode-only steps take the decode kernel (split-K
for few long requests), anything else the chunked-prefill kernel."""

import pytest
import torch

from tests.kernels.cases import assert_matches, make_batch
from worker_svc.attention import triton_backend


def step_kv(batch):
    """Slot mapping and K/V of this step's tokens (the last q_len of each request),
    then those cache slots poisoned, so attention sees them only if write_kv works."""
    m, page = batch.meta, batch.kv_cache.shape[2]
    starts, slots = m.query_start_loc.tolist(), []
    for i, seq_len in enumerate(m.seq_lens.tolist()):
        for pos in range(seq_len - (starts[i + 1] - starts[i]), seq_len):
            slots.append(int(m.block_table[i, pos // page]) * page + pos % page)
    slots = torch.tensor(slots, dtype=torch.int64)
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    key, value = flat[0, slots].clone(), flat[1, slots].clone()
    flat[:, slots] = float("nan")
    return key, value, slots


@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1, 1, 1], [1, 17, 32]),  # decodes: one kernel launch, no split
    ([1], [600]),  # one long decode: 3 programs on 64 SMs, split-K
    ([5, 1, 12], [21, 16, 12]),  # mixed prefill and decode
], ids=["decodes", "long_decode_split_k", "mixed"])
def test_write_then_attend_matches_reference(q_lens, seq_lens):
    batch = make_batch(q_lens, seq_lens, dtype=torch.bfloat16)
    want = batch.expected()
    key, value, slots = step_kv(batch)
    triton_backend.write_kv(key, value, batch.kv_cache, slots)
    got = triton_backend.attention(batch.query, batch.kv_cache, batch.meta, batch.scale)
    assert_matches(got, batch)
    assert torch.equal(batch.expected(), want)  # the cache is whole again


def test_one_long_decode_with_the_cpu_sm_default_takes_split_k():
    assert triton_backend.choose_num_splits(1, 3, 600, triton_backend._num_sms(
        torch.device("cpu"))) == 2


def test_mismatched_query_and_cache_are_rejected():
    batch = make_batch([1], [3])
    with pytest.raises(ValueError, match="does not match"):
        triton_backend.attention(batch.query.half(), batch.kv_cache, batch.meta, batch.scale)
    with pytest.raises(ValueError, match="kv_cache"):
        triton_backend.attention(batch.query, batch.kv_cache[0], batch.meta, batch.scale)
