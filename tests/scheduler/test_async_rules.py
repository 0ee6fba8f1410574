"""Async scheduling: step N+1 is scheduled before step N's tokens are known."""

import pytest

from shared.types import FinishReason
from tests.scheduler.helpers import (
    EOS, FakeWorker, drive, drive_async, joined, make_request, make_scheduler,
    serve_five_in_a_small_pool,
)


def test_placeholder_gives_a_generating_request_a_gap_of_one():
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request("a", 10, max_tokens=5))
    s.schedule()
    req = s.requests["a"]
    assert (req.num_computed_tokens, req.num_output_placeholders, req.gap) == (10, 1, 1)
    so2 = s.schedule()  # before step 1's token is known
    assert so2.num_scheduled_tokens == {"a": 1}
    assert so2.scheduled_cached_reqs.num_computed_tokens == [10]
    assert (req.num_computed_tokens, req.num_output_placeholders) == (11, 2)


def test_non_final_prefill_chunk_adds_no_placeholder():
    s = make_scheduler(async_scheduling=True, max_num_batched_tokens=16)
    s.add_request(make_request("a", 40))
    s.schedule()
    assert s.requests["a"].num_output_placeholders == 0


def test_update_replaces_placeholders_with_real_tokens():
    s = make_scheduler(async_scheduling=True)
    w = FakeWorker()
    s.add_request(make_request("a", 10, max_tokens=5))
    so1 = s.schedule()
    m1 = w.execute(so1)
    so2 = s.schedule()
    m2 = w.execute(so2)
    (out,) = s.update_from_output(so1, m1)
    req = s.requests["a"]
    assert out.new_token_ids == [1010]
    assert (req.num_tokens, req.num_output_placeholders, req.num_computed_tokens) == (11, 1, 11)
    s.update_from_output(so2, m2)
    assert (req.num_tokens, req.num_output_placeholders) == (12, 0)


def test_async_output_equals_sync_output():
    sync_tokens, _ = serve_five_in_a_small_pool(drive, async_scheduling=False)
    async_tokens, stats = serve_five_in_a_small_pool(drive_async, async_scheduling=True)
    assert async_tokens == sync_tokens
    # the pool is small on purpose: preemption with steps in flight
    assert stats.num_preemptions_total > 0


def test_token_computed_after_eos_is_discarded():
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request("a", 10, max_tokens=10))
    outs = drive_async(s, FakeWorker(lambda rid, pos: EOS if pos == 12 else 7))
    assert joined(outs)["a"] == [7, 7, EOS]
    assert outs["a"][-1].finish_reason == FinishReason.STOP
    assert s.num_free_blocks == s.num_total_blocks - 1


def test_request_known_to_reach_max_tokens_is_not_scheduled_again():
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request("a", 10, max_tokens=1))
    s.schedule()
    assert s.schedule().num_scheduled_tokens == {}


def test_request_known_to_reach_max_model_len_is_not_scheduled_again():
    s = make_scheduler(async_scheduling=True, max_model_len=32)
    s.add_request(make_request("a", 31, max_tokens=10))
    s.schedule()
    assert s.schedule().num_scheduled_tokens == {}


def test_in_flight_output_of_a_preempted_request_is_applied_exactly_once():
    s = make_scheduler(num_blocks=9, async_scheduling=True, max_num_batched_tokens=128,
                       max_model_len=128)
    for name, n in (("r0", 20), ("r1", 30), ("r2", 40)):
        s.add_request(make_request(name, n, max_tokens=60))
    outs = drive_async(s, FakeWorker())
    assert s.stats().num_preemptions_total > 0
    for name, n in (("r0", 20), ("r1", 30), ("r2", 40)):
        assert joined(outs)[name] == [1000 + n + k for k in range(60)]


def test_only_committed_tokens_are_hashed_into_the_prefix_cache():
    s = make_scheduler(async_scheduling=True)
    w = FakeWorker()
    s.add_request(make_request("a", 15, max_tokens=5))
    so1 = s.schedule()  # computes positions 0..14
    m1 = w.execute(so1)
    so2 = s.schedule()  # computes position 15 with a placeholder token: block 0 full
    m2 = w.execute(so2)
    assert len(s.kv.pool.cached) == 0
    s.update_from_output(so1, m1)  # the token at position 15 is now committed ...
    assert len(s.kv.pool.cached) == 0  # ... but the step writing its KV is not
    so3 = s.schedule()
    s.update_from_output(so2, m2)  # block 0's KV is written: now it may be hit
    assert len(s.kv.pool.cached) == 1
    assert s.requests["a"].block_hashes[0] in s.kv.pool.cached
    del so3


def test_at_most_two_steps_are_in_flight():
    s = make_scheduler(async_scheduling=True)
    w = FakeWorker()
    s.add_request(make_request("a", 10, max_tokens=5))
    so1 = s.schedule()
    s.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        s.schedule()
    s.update_from_output(so1, w.execute(so1))
    s.schedule()
