"""Worker loss: the workers forget every request, the scheduler keeps them all and
recomputes (Scheduler.requeue_all_for_recompute). Nothing is lost and the tokens
are those of a run without the fault."""

from scheduler_svc.core.request import RequestStatus
from tests.scheduler.helpers import (
    FakeWorker, check_invariants, drive, drive_async, joined, make_request, make_scheduler,
)


def _token(rid, pos):
    return 500 + (pos * 7 + len(rid)) % 97


def _requests():
    return [make_request(f"r{i}", 20 + 7 * i, max_tokens=15 + i) for i in range(6)]


def _reference(async_scheduling, num_blocks=24):
    s = make_scheduler(num_blocks=num_blocks, async_scheduling=async_scheduling,
                       max_num_batched_tokens=48, max_model_len=128)
    for r in _requests():
        s.add_request(r)
    return joined((drive_async if async_scheduling else drive)(s, FakeWorker(_token)))


def _run_steps(s, worker, n):
    """n synchronous steps; the outputs per request."""
    outs = {}
    for _ in range(n):
        so = s.schedule()
        for out in s.update_from_output(so, worker.execute(so)):
            outs.setdefault(out.req_id, []).append(out)
    return outs


def test_requeue_puts_running_at_the_front_of_waiting_in_admission_order():
    s = make_scheduler(num_blocks=64, max_num_seqs=3)
    for r in _requests():
        s.add_request(r)
    _run_steps(s, FakeWorker(_token), 3)
    running = [r.req_id for r in s.running]
    waiting_before = [r.req_id for r in s.waiting]
    assert len(running) == 3 and waiting_before
    assert s.requeue_all_for_recompute() == running
    assert s.running == []
    assert [r.req_id for r in s.waiting] == running + waiting_before
    for req_id in running:
        req = s.requests[req_id]
        assert req.status is RequestStatus.PREEMPTED
        assert (req.num_computed_tokens, req.num_output_placeholders) == (0, 0)
        assert req.output_token_ids  # generated tokens are kept
        assert req.worker_forgot
    assert s.num_free_blocks == s.num_total_blocks - 1
    check_invariants(s)


def test_requeue_drops_in_flight_steps_placeholders_and_the_prefix_cache():
    s = make_scheduler(num_blocks=64, async_scheduling=True)
    for r in _requests():
        s.add_request(r)
    w = FakeWorker(_token)
    so1 = s.schedule()
    s.update_from_output(so1, w.execute(so1))
    s.schedule()
    s.schedule()  # two steps in flight, their results never come
    assert len(s.in_flight) == 2
    assert any(r.num_output_placeholders for r in s.running)
    assert s.kv.pool.cached  # full prompt blocks were registered
    s.requeue_all_for_recompute()
    assert s.in_flight == {}
    assert all(r.num_output_placeholders == 0 for r in s.requests.values())
    assert s.kv.pool.cached == {} and all(b.block_hash is None for b in s.kv.pool.blocks)
    assert s.stats().kv_usage == 0.0
    so = s.schedule()  # schedules again: nothing in flight blocks it
    assert so.total_num_scheduled_tokens > 0
    check_invariants(s, so)


def test_requests_are_resent_whole_to_a_fresh_worker():
    s = make_scheduler(num_blocks=64)
    s.add_request(make_request("a", 10, max_tokens=8))
    _run_steps(s, FakeWorker(_token), 3)
    done = list(s.requests["a"].output_token_ids)
    assert len(done) == 3
    s.requeue_all_for_recompute()
    so = s.schedule()
    assert so.scheduled_cached_reqs.req_ids == []
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "a" and new.output_token_ids == done
    assert new.prompt_token_ids == s.requests["a"].prompt_token_ids
    assert so.num_scheduled_tokens == {"a": 13}  # prompt + output recomputed
    assert not s.requests["a"].worker_forgot  # sent once; later steps are increments


def _fault_run(async_scheduling, fault_after_steps, num_blocks=24):
    s = make_scheduler(num_blocks=num_blocks, async_scheduling=async_scheduling,
                       max_num_batched_tokens=48, max_model_len=128)
    for r in _requests():
        s.add_request(r)
    old = FakeWorker(_token)
    before = {}
    in_flight = []
    for _ in range(fault_after_steps):  # steps in flight when the worker dies are lost
        so = s.schedule()
        in_flight.append((so, old.execute(so)))
        if len(in_flight) == (2 if async_scheduling else 1):
            so, mro = in_flight.pop(0)
            for out in s.update_from_output(so, mro):
                before.setdefault(out.req_id, []).append(out)
    preempted_before = [r.req_id for r in s.waiting if r.status is RequestStatus.PREEMPTED]
    s.requeue_all_for_recompute()
    check_invariants(s)
    after = (drive_async if async_scheduling else drive)(s, FakeWorker(_token))
    tokens = joined(before)
    for req_id, toks in joined(after).items():
        tokens.setdefault(req_id, []).extend(toks)
    assert s.num_free_blocks == s.num_total_blocks - 1
    return tokens, preempted_before


def test_output_after_worker_loss_equals_the_no_fault_output():
    for async_scheduling in (False, True):
        reference = _reference(async_scheduling)
        for fault_after in (1, 4, 9, 20):
            tokens, _ = _fault_run(async_scheduling, fault_after)
            assert tokens == reference, (async_scheduling, fault_after)


def test_requests_preempted_before_the_loss_are_resent_whole_too():
    # the small pool preempts before the fault: those requests were held by the old
    # worker as preempted (token ids kept) and must reach the new one as new
    # (a FakeWorker raises KeyError on a cached request it does not hold)
    tokens, preempted_before = _fault_run(False, 5, num_blocks=16)
    assert preempted_before
    assert tokens == _reference(False, num_blocks=16)
