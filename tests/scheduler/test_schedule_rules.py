"""schedule(): one test per rule of docs/scheduling.md."""

import pytest

from scheduler_svc.core import RequestStatus
from shared.types import FinishReason, InvalidRequestError
from tests.scheduler.helpers import (FakeWorker, check_invariants, make_door, make_request,
                                     make_scheduler)


def step(sched, worker):
    so = sched.schedule()
    check_invariants(sched, so)
    outs = sched.update_from_output(so, worker.execute(so))
    check_invariants(sched)
    return so, {o.req_id: o for o in outs}


def decode_until_running(sched, worker, n):
    while len(sched.running) < n or any(r.gap > 1 for r in sched.running):
        step(sched, worker)


# --- limits of one step -------------------------------------------------------

def test_scheduled_tokens_never_exceed_the_token_budget():
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=64, max_num_seqs=8)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 40))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"r0": 40, "r1": 24}
    assert so.total_num_scheduled_tokens == 64


def test_running_never_exceeds_max_num_seqs():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 5))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert s.stats().admission_blocked_by == "max_num_seqs"


def test_decoders_take_one_token_each_and_a_prefill_gets_what_remains():
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=32, max_num_seqs=8)
    w = FakeWorker()
    for i in range(3):
        s.add_request(make_request(f"d{i}", 4, max_tokens=50))
    step(s, w)
    s.add_request(make_request("long", 100))
    so, _ = step(s, w)
    assert [so.num_scheduled_tokens[f"d{i}"] for i in range(3)] == [1, 1, 1]
    assert so.num_scheduled_tokens["long"] == 29


def test_chunked_prefill_continues_in_later_steps_from_running():
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    w = FakeWorker()
    s.add_request(make_request("a", 40))
    chunks = []
    for _ in range(3):
        so, outs = step(s, w)
        chunks.append(so.num_scheduled_tokens["a"])
        if len(chunks) < 3:
            assert "a" not in outs  # a non-final chunk samples nothing
    assert chunks == [16, 16, 8]
    assert len(outs["a"].new_token_ids) == 1


def test_without_chunked_prefill_a_prompt_is_admitted_only_whole():
    s = make_scheduler(max_num_batched_tokens=256, max_num_seqs=4,
                       enable_chunked_prefill=False)
    s.add_request(make_request("a", 200))
    s.add_request(make_request("b", 100))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 200}
    assert s.stats().admission_blocked_by == "token_budget"


def test_long_prefill_threshold_caps_each_request_per_step():
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=256, max_num_seqs=4,
                       long_prefill_token_threshold=32)
    s.add_request(make_request("a", 100))
    s.add_request(make_request("b", 10))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 32, "b": 10}


def test_long_prefill_threshold_not_applied_when_only_one_request_is_eligible():
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=256, max_num_seqs=4,
                       long_prefill_token_threshold=32)
    s.add_request(make_request("a", 100))
    assert s.schedule().num_scheduled_tokens == {"a": 100}


def test_long_prefill_threshold_caps_a_lone_request_too_with_vllms_rule():
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=256, max_num_seqs=4,
                       long_prefill_token_threshold=32, long_prefill_exempt_lone_request=False)
    s.add_request(make_request("a", 100))
    assert s.schedule().num_scheduled_tokens == {"a": 32}


def test_request_never_grows_past_max_model_len():
    s = make_scheduler(max_model_len=40, max_num_batched_tokens=64)
    w = FakeWorker()
    s.add_request(make_request("a", 30, max_tokens=100))
    tokens = []
    while s.has_unfinished_requests():
        so, outs = step(s, w)
        assert all(r.num_computed_tokens <= 39 for r in s.running)
        if "a" in outs:
            tokens += outs["a"].new_token_ids
            last = outs["a"]
    assert len(tokens) == 10 and last.finish_reason == FinishReason.LENGTH


def test_prompt_that_leaves_no_room_for_output_is_rejected_at_the_door():
    door = make_door(max_model_len=64)
    with pytest.raises(InvalidRequestError, match="64"):
        door.check(make_request("a", 64, max_tokens=1))
    door.check(make_request("b", 63, max_tokens=1))
    s = make_scheduler(max_model_len=64)
    with pytest.raises(AssertionError, match="64"):  # behind the door the core asserts it
        s.add_request(make_request("a", 64))
    assert not s.has_unfinished_requests() and len(s.waiting) == 0
    s.add_request(make_request("b", 63))


def test_the_core_refuses_a_held_id_and_the_door_an_empty_or_invalid_request():
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    with pytest.raises(InvalidRequestError, match="already in use"):
        s.add_request(make_request("a", 5))
    door = make_door()
    with pytest.raises(InvalidRequestError, match="empty"):
        door.check(make_request("b", []))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        door.check(make_request("c", 5, max_tokens=0))
    assert len(s.waiting) == 1 and list(s.requests) == ["a"]


# --- preemption ---------------------------------------------------------------

def grow_until_preemption(s, w):
    for _ in range(500):
        so, outs = step(s, w)
        if so.preempted_req_ids:
            return so, outs
    raise AssertionError("no preemption")


def three_growing(s, prios=(0, 0, 0)):
    """8 usable blocks: prompts of 20, 30 and 40 tokens take 7; growth needs more."""
    for i, (name, n) in enumerate((("r0", 20), ("r1", 30), ("r2", 40))):
        s.add_request(make_request(name, n, max_tokens=60, priority=prios[i], arrival=float(i)))


def test_fcfs_victim_is_the_most_recently_admitted_and_goes_to_front_of_waiting():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=128, max_model_len=128,
                       max_num_seqs=3)
    w = FakeWorker()
    three_growing(s)
    s.add_request(make_request("later", 4))  # waits: max_num_seqs is taken
    so, _ = grow_until_preemption(s, w)
    assert so.preempted_req_ids == {"r2"}
    victim = s.requests["r2"]
    assert victim.status is RequestStatus.PREEMPTED and victim.num_preemptions == 1
    assert victim.num_computed_tokens == 0 and victim.num_output_tokens > 0
    assert s.waiting.peek() is victim
    assert "r2" not in so.num_scheduled_tokens
    assert s.stats().num_preemptions_total == 1 and s.stats().num_waiting_preempted == 1


def test_priority_victim_is_least_important_with_ties_to_latest_arrival():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=128, max_model_len=128,
                       policy="priority")
    w = FakeWorker()
    three_growing(s, prios=(5, 0, 0))
    so, _ = grow_until_preemption(s, w)
    assert so.preempted_req_ids == {"r0"}
    so, _ = grow_until_preemption(s, w)
    assert so.preempted_req_ids == {"r2"}


def test_priority_victim_already_scheduled_this_step_is_refunded():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=128, max_model_len=128,
                       policy="priority")
    w = FakeWorker()
    three_growing(s, prios=(5, 0, 0))
    so, _ = grow_until_preemption(s, w)
    # r0 sits first in RUNNING, is scheduled first, then becomes r2's victim.
    assert so.preempted_req_ids == {"r0"}
    assert "r0" not in so.num_scheduled_tokens
    assert "r0" not in so.scheduled_cached_reqs.req_ids
    assert set(so.num_scheduled_tokens) == {"r1", "r2"}
    assert so.total_num_scheduled_tokens == 2
    assert s.kv.get_block_ids("r0") == []


def test_preempted_request_output_is_kept_and_continues_after_resume():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=128, max_num_seqs=4,
                       max_model_len=128)
    w = FakeWorker()
    for i in range(3):
        s.add_request(make_request(f"r{i}", 40, max_tokens=60))
    tokens: dict[str, list[int]] = {}
    resumed_seen = False
    while s.has_unfinished_requests():
        so, outs = step(s, w)
        cached = so.scheduled_cached_reqs
        for req_id, resumed, blocks in zip(cached.req_ids, cached.resumed_from_preemption,
                                           cached.new_block_ids):
            if resumed:  # the full new block table, not an increment
                resumed_seen = True
                assert blocks == s.get_block_ids(req_id)
        for req_id, out in outs.items():
            tokens.setdefault(req_id, []).extend(out.new_token_ids)
    assert resumed_seen
    for i in range(3):  # nothing sampled twice, nothing lost
        assert tokens[f"r{i}"] == [1000 + 40 + k for k in range(60)]


def test_no_request_is_admitted_in_a_step_that_preempted():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=128, max_model_len=128,
                       max_num_seqs=3)
    w = FakeWorker()
    three_growing(s)
    s.add_request(make_request("tiny", 1))  # fits once r2 is preempted, but not this step
    so, _ = grow_until_preemption(s, w)
    assert not so.scheduled_new_reqs
    assert s.stats().admission_blocked_by == "preemption"


def test_preempted_request_hits_its_own_prefix_on_resume():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=128, max_model_len=128)
    w = FakeWorker()
    three_growing(s)
    grow_until_preemption(s, w)
    lost = s.requests["r2"].num_lost_tokens
    assert lost >= 48 and s.stats().num_recomputed_tokens_total == 0  # counted on resume
    s.abort_requests(["r0"])  # frees room so r2 comes back at once
    so, _ = step(s, w)
    assert s.stats().num_recomputed_tokens_total == lost - 48  # only the part not hit
    cached = so.scheduled_cached_reqs
    k = cached.req_ids.index("r2")
    assert cached.resumed_from_preemption[k]
    assert cached.num_computed_tokens[k] == 48
    assert cached.new_block_ids[k] == s.get_block_ids("r2")


# --- admission ----------------------------------------------------------------

def test_head_of_line_blocking_stops_admission_when_the_head_does_not_fit():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=256, max_model_len=128)
    s.add_request(make_request("big", 100))  # 7 of 8 blocks
    s.add_request(make_request("huge", 120))  # would need 8
    s.add_request(make_request("small", 4))  # would fit, but must wait its turn
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"big"}
    assert s.stats().admission_blocked_by == "kv_cache"


def test_waiting_requests_never_cause_preemption():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=256, max_model_len=128)
    w = FakeWorker()
    s.add_request(make_request("a", 100, max_tokens=5))
    step(s, w)
    s.add_request(make_request("b", 100))
    so, _ = step(s, w)
    assert not so.preempted_req_ids and "b" not in so.num_scheduled_tokens


def test_fcfs_admits_in_arrival_order_and_priority_by_priority_then_arrival():
    for policy, expected in (("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"])):
        s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=8, policy=policy)
        s.add_request(make_request("a", 8, priority=1, arrival=0.0))
        s.add_request(make_request("b", 8, priority=1, arrival=1.0))
        s.add_request(make_request("c", 8, priority=0, arrival=2.0))
        order = [r.req_id for r in s.waiting]
        assert order == expected


def test_new_request_data_is_sent_once_then_only_increments():
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    w = FakeWorker()
    s.add_request(make_request("a", 20, max_tokens=20))
    so, _ = step(s, w)
    (new,) = so.scheduled_new_reqs
    assert new.prompt_token_ids == s.requests["a"].prompt_token_ids
    assert new.block_ids == s.get_block_ids("a") and new.num_computed_tokens == 0
    so, _ = step(s, w)
    assert not so.scheduled_new_reqs
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [16]
    assert so.scheduled_cached_reqs.resumed_from_preemption == [False]
    assert so.scheduled_cached_reqs.new_block_ids == [s.get_block_ids("a")[1:]]


def test_prefix_cache_hit_shrinks_the_initial_gap_and_is_counted_in_tokens():
    s = make_scheduler(max_num_batched_tokens=256, max_num_seqs=4)
    w = FakeWorker()
    shared = list(range(500, 540))
    s.add_request(make_request("a", shared + [1, 2], max_tokens=1))
    step(s, w)
    s.add_request(make_request("b", shared + [3, 4, 5], max_tokens=1))
    so, outs = step(s, w)
    assert so.num_scheduled_tokens["b"] == 43 - 32
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    assert outs["b"].num_cached_tokens == 32
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (42 + 43, 32)


def test_cache_salt_separates_prefix_caches():
    s = make_scheduler(max_num_batched_tokens=256, max_num_seqs=4)
    w = FakeWorker()
    shared = list(range(500, 540))
    s.add_request(make_request("a", shared + [1], max_tokens=1, salt="tenant-a"))
    step(s, w)
    s.add_request(make_request("b", shared + [1], max_tokens=1, salt="tenant-b"))
    so, _ = step(s, w)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


# --- abort --------------------------------------------------------------------

def test_abort_of_running_or_waiting_request_frees_blocks_at_once():
    s = make_scheduler(num_blocks=20, max_num_batched_tokens=64, max_num_seqs=1)
    w = FakeWorker()
    s.add_request(make_request("run", 40, max_tokens=50))
    s.add_request(make_request("wait", 10))
    step(s, w)
    outs = s.abort_requests(["run", "wait", "unknown"])
    assert [(o.req_id, o.finish_reason) for o in outs] == [
        ("run", FinishReason.ABORT), ("wait", FinishReason.ABORT)]
    assert s.num_free_blocks == s.num_total_blocks - 1
    assert not s.has_unfinished_requests() and len(s.waiting) == 0 and not s.running
    so = s.schedule()
    assert so.finished_req_ids == {"run", "wait"} and not so.num_scheduled_tokens
