"""A request that fails by itself (core/step_failure.py, docs/resilience.md): a failed
step is retried once by recompute, the suspects then run alone, and only the culprit
is failed; everyone else finishes with the tokens of a run without it, and the KV
pool empties. A request in flight at two worker losses in a row is failed too."""

import pytest

from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.step_failure import MAX_FAILED_STEPS
from shared.types import ModelRunnerOutput
from tests.scheduler.helpers import (FakeWorker, check_invariants, joined, make_request,
                                     make_scheduler)

POISON = 77


def _token(rid, pos):
    return 500 + (pos * 7 + len(rid)) % 97


class FailingWorker(FakeWorker):
    """A FakeWorker that fails like worker_svc/server.py's StepPipe: a step whose
    scheduled tokens include POISON (or that `fails(step)` picks) is answered with an
    error and every request is dropped; later steps are skipped until one says
    reset_requests. `steps` records (step id, request ids, failed) of each step run."""

    def __init__(self, next_token=_token, fails=lambda so, worker: False) -> None:
        super().__init__(next_token)
        self.fails = fails
        self.failed_at = None
        self.steps: list[tuple[int, tuple[str, ...], bool]] = []

    def execute(self, so):
        if so.reset_requests:
            self.tokens.clear()
            self.params.clear()
            self.stopped.clear()
            self.failed_at = None
        elif self.failed_at is not None:
            return ModelRunnerOutput(step_id=so.step_id, step_skipped=True,
                                     error=f"not run: step {self.failed_at} failed before it")
        ids = tuple(so.num_scheduled_tokens)
        if self._poisoned(so) or self.fails(so, self):
            self.failed_at = so.step_id
            self.tokens.clear()
            self.params.clear()
            self.stopped.clear()
            self.steps.append((so.step_id, ids, True))
            return ModelRunnerOutput(step_id=so.step_id, error="RuntimeError: poison")
        self.steps.append((so.step_id, ids, False))
        return super().execute(so)

    def _poisoned(self, so) -> bool:
        tokens = {r: list(t) for r, t in self.tokens.items()}
        computed = {}
        for new in so.scheduled_new_reqs:
            tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        return any(POISON in tokens[r][computed[r]:computed[r] + n]
                   for r, n in so.num_scheduled_tokens.items())


def drive(s, worker, depth):
    """Steps until every request ended, `depth` in flight (2: async scheduling), the
    failures handled as the engine does. Returns (outputs, failed {id: why})."""
    outputs, failed = {}, {}
    in_flight = []
    for _ in range(5000):
        if not in_flight and not s.has_unfinished_requests():
            break
        if len(in_flight) < depth and s.has_unfinished_requests():
            so = s.schedule()
            check_invariants(s, so)
            in_flight.append((so, worker.execute(so)))  # the worker runs steps in order
            if len(in_flight) < depth:
                continue
        so, mro = in_flight.pop(0)
        if mro.error:
            assert not mro.step_skipped  # the oldest step in flight is the one that failed
            for req_id, why in s.step_failed(so.step_id, mro.error):
                failed[req_id] = why
            in_flight.clear()  # the later ones were skipped by the worker
        else:
            for out in s.update_from_output(so, mro):
                outputs.setdefault(out.req_id, []).append(out)
        check_invariants(s)
    else:
        raise AssertionError("requests did not end")
    assert s.num_free_blocks == s.num_total_blocks - 1  # the failed ones' KV too
    return outputs, failed


def _scheduler(async_scheduling):
    return make_scheduler(num_blocks=64, async_scheduling=async_scheduling,
                          max_num_batched_tokens=64, max_model_len=128)


def _others():
    return [make_request(f"ok{i}", 12 + 5 * i, max_tokens=10 + i) for i in range(4)]


def _reference(async_scheduling):
    s = _scheduler(async_scheduling)
    for r in _others():
        s.add_request(r)
    outputs, failed = drive(s, FailingWorker(), 2 if async_scheduling else 1)
    assert not failed
    return joined(outputs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_failing_every_step_fails_alone_after_one_retry_and_the_rest_finish_equal(
        async_scheduling):
    s = _scheduler(async_scheduling)
    s.add_request(make_request("ok0", 12, max_tokens=10))
    s.add_request(make_request("bad", [5, 6, POISON, 8], max_tokens=10))
    for r in _others()[1:]:
        s.add_request(r)
    worker = FailingWorker()
    outputs, failed = drive(s, worker, 2 if async_scheduling else 1)
    assert list(failed) == ["bad"] and "alone, after retrying it once" in failed["bad"]
    assert "RuntimeError: poison" in failed["bad"]
    assert {r: t for r, t in joined(outputs).items() if r != "bad"} == _reference(
        async_scheduling)
    fails = [(ids, bad) for _, ids, bad in worker.steps if bad]
    # the step, its retry with everyone, then the suspects alone until the culprit
    assert len(fails) == 3 and fails[-1][0] == ("bad",)
    assert all(len(ids) > 1 for ids, _ in fails[:2])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_suspects_run_alone_one_at_a_time_until_the_culprit_is_found(async_scheduling):
    s = _scheduler(async_scheduling)
    for r in _others()[:2]:
        s.add_request(r)
    s.add_request(make_request("bad", [5, 6, POISON, 8], max_tokens=10))
    worker = FailingWorker()
    _, failed = drive(s, worker, 2 if async_scheduling else 1)
    assert list(failed) == ["bad"]
    second = [i for i, (_, _, bad) in enumerate(worker.steps) if bad][1]
    culprit = [i for i, (_, _, bad) in enumerate(worker.steps) if bad][2]
    # between the retry that failed and the culprit's own failure, every step held one
    # suspect alone: ok0, then ok1 (cleared once computed past the failed point), then bad
    solo = [ids for _, ids, _ in worker.steps[second + 1:culprit + 1] if ids]
    assert all(len(ids) == 1 for ids in solo)
    assert [ids[0] for ids in solo][-1] == "bad" and {ids[0] for ids in solo} == {
        "ok0", "ok1", "bad"}


def test_a_request_failing_alone_is_retried_once_then_failed():
    s = _scheduler(False)
    s.add_request(make_request("bad", [POISON, 1, 2], max_tokens=5))
    worker = FailingWorker()
    outputs, failed = drive(s, worker, 1)
    assert list(failed) == ["bad"] and "bad" not in outputs
    assert [bad for _, _, bad in worker.steps] == [True, True]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_poison_token_sampled_later_fails_only_its_request(async_scheduling):
    def token(rid, pos):  # "bad" samples the poison token as its 3rd output
        return POISON if rid == "bad" and pos == 12 + 2 else _token(rid, pos)

    s = _scheduler(async_scheduling)
    s.add_request(make_request("bad", 12, max_tokens=10))
    for r in _others():
        s.add_request(r)
    outputs, failed = drive(s, FailingWorker(token), 2 if async_scheduling else 1)
    assert list(failed) == ["bad"]
    tokens = joined(outputs)
    assert tokens["bad"][-1] == POISON  # streamed before its step failed
    assert {r: t for r, t in tokens.items() if r != "bad"} == _reference(async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_that_fails_once_is_retried_and_fails_nobody(async_scheduling):
    once = {"left": 1}

    def fails(so, worker):  # the 4th step fails, whatever it holds; then never again
        if len(worker.steps) == 3 and once["left"]:
            once["left"] = 0
            return True
        return False

    s = _scheduler(async_scheduling)
    requests = _others()
    for r in requests:
        s.add_request(r)
    outputs, failed = drive(s, FailingWorker(fails=fails), 2 if async_scheduling else 1)
    assert not failed and joined(outputs) == _reference(async_scheduling)
    assert all(r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
               for r in requests)
    assert not s.failures.suspects and not s.failures._marked


def test_the_step_after_a_failure_resets_the_workers_and_resends_every_request():
    s = _scheduler(True)
    for r in _others()[:2]:
        s.add_request(r)
    w = FailingWorker()
    so1 = s.schedule()
    s.update_from_output(so1, w.execute(so1))
    failing = s.schedule()
    s.schedule()  # step N + 1, in flight behind the failing one
    assert s.step_failed(failing.step_id, "RuntimeError: x") == []
    assert s.in_flight == {} and s.running == []
    reset = s.schedule()
    assert reset.reset_requests
    assert sorted(n.req_id for n in reset.scheduled_new_reqs) == ["ok0", "ok1"]
    assert all(n.output_token_ids for n in reset.scheduled_new_reqs)  # resent whole
    assert not s.schedule().reset_requests


def test_a_reset_is_sent_even_when_the_failure_left_nothing_to_run():
    s = _scheduler(False)
    s.add_request(make_request("bad", [POISON], max_tokens=5))
    for _ in range(2):
        so = s.schedule()
        failed = s.step_failed(so.step_id, "RuntimeError: x")
    assert [r for r, _ in failed] == ["bad"] and not s.has_unfinished_requests()
    last = s.schedule()
    assert last.reset_requests and not last.total_num_scheduled_tokens


def test_a_failure_only_some_batches_trigger_still_progresses_and_fails_nobody():
    # any step of two or more requests fails: alone each one passes (and samples a
    # token once recomputed), batched it fails again; every request still finishes
    s = _scheduler(False)
    for r in _others()[:3]:
        s.add_request(r)
    outputs, failed = drive(s, FailingWorker(fails=lambda so, w: len(so.num_scheduled_tokens) > 1),
                            1)
    assert not failed
    assert {r: t for r, t in joined(outputs).items()} == {
        r: t for r, t in _reference(False).items() if r in ("ok0", "ok1", "ok2")}


def test_a_request_in_failed_steps_without_a_new_token_between_them_is_failed_at_the_bound():
    s = _scheduler(False)
    for r in _others()[:2]:
        s.add_request(r)
    so = s.schedule()
    step = dict(s.in_flight[so.step_id])
    for k in range(1, MAX_FAILED_STEPS + 1):  # the same two requests, no token between
        failed = s.failures.step_failed(step, "RuntimeError: x")
        assert (failed == []) == (k < MAX_FAILED_STEPS)
    assert sorted(r.req_id for r, _ in failed) == ["ok0", "ok1"]
    assert f"in {MAX_FAILED_STEPS} failed steps without a new token" in failed[0][1]
    a = step["ok0"].request
    a.output_token_ids.append(5)  # a new token restarts the count
    again = s.failures.step_failed(step, "RuntimeError: x")
    assert [r.req_id for r, _ in again] == ["ok1"] and a.num_failed_steps == 1


def test_a_request_in_flight_alone_at_two_worker_losses_in_a_row_is_failed():
    s = _scheduler(False)
    s.add_request(make_request("a", 10, max_tokens=8))
    w = FakeWorker(_token)
    so = s.schedule()
    s.update_from_output(so, w.execute(so))  # "a" is running
    s.schedule()  # in flight when the worker dies
    running, failed = s.worker_lost("UNAVAILABLE: Socket closed")
    assert running == ["a"] and failed == []
    s.schedule()  # "a" resent whole: the worker dies again before answering
    running, failed = s.worker_lost("UNAVAILABLE: Socket closed")
    assert running == ["a"] and [r for r, _ in failed] == ["a"]
    assert "died with this request in flight" in failed[0][1] and "Socket closed" in failed[0][1]
    assert not s.has_unfinished_requests() and s.num_free_blocks == s.num_total_blocks - 1
    assert not s.schedule().reset_requests  # a fresh worker holds nothing to drop


def drive_losses(s, depth):
    """Like drive(), but a POISON step kills the worker: the steps in flight are lost
    and a fresh worker (nothing held) serves on. Returns (outputs, failed, losses)."""
    outputs, failed, losses = {}, {}, 0
    worker = FailingWorker()
    in_flight = []
    for _ in range(5000):
        if not in_flight and not s.has_unfinished_requests():
            break
        if len(in_flight) < depth and s.has_unfinished_requests():
            so = s.schedule()
            check_invariants(s, so)
            in_flight.append((so, worker.execute(so)))
            if len(in_flight) < depth:
                continue
        so, mro = in_flight.pop(0)
        if mro.error:  # the worker died in it: everything in flight is lost
            losses += 1
            _, lost = s.worker_lost("UNAVAILABLE: Socket closed")
            failed.update(lost)
            in_flight.clear()
            worker = FailingWorker()
        else:
            for out in s.update_from_output(so, mro):
                outputs.setdefault(out.req_id, []).append(out)
        check_invariants(s)
    assert s.num_free_blocks == s.num_total_blocks - 1
    return outputs, failed, losses


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_kills_the_worker_batched_is_isolated_and_only_it_is_failed(
        async_scheduling):
    s = _scheduler(async_scheduling)
    s.add_request(make_request("bad", [5, 6, POISON, 8], max_tokens=10))
    for r in _others():
        s.add_request(r)
    outputs, failed, losses = drive_losses(s, 2 if async_scheduling else 1)
    assert list(failed) == ["bad"] and losses == 3  # the loss, the retry, bad alone
    assert {r: t for r, t in joined(outputs).items() if r != "bad"} == _reference(
        async_scheduling)


def test_a_request_that_got_past_a_worker_loss_starts_counting_again():
    s = _scheduler(False)
    s.add_request(make_request("a", 10, max_tokens=20))
    for _ in range(3):
        s.schedule()
        _, failed = s.worker_lost("UNAVAILABLE: Socket closed")
        assert failed == []
        w = FakeWorker(_token)  # a fresh worker: "a" is resent whole and recomputed
        so = s.schedule()
        s.update_from_output(so, w.execute(so))  # computed past the lost step: cleared
        assert s.requests["a"].num_strikes == 0


def test_one_recompute_clears_the_requests_of_a_loss_with_two_steps_in_flight():
    # the failure point is the oldest step's, whose inputs are all committed, so the
    # recompute reaches it: no extra steps alone at the next loss for an innocent one
    s = _scheduler(True)
    for r in _others()[:2]:
        s.add_request(r)
    w = FakeWorker(_token)
    so = s.schedule()
    s.update_from_output(so, w.execute(so))  # prefills: both sampled
    s.schedule()
    s.schedule()  # two decode steps in flight, the second on the first's placeholder
    s.worker_lost("UNAVAILABLE: Socket closed")
    assert all(r.num_strikes == 1 for r in s.requests.values())
    w = FakeWorker(_token)
    so = s.schedule()  # resent whole: prompt + output recomputed
    s.update_from_output(so, w.execute(so))
    assert all(r.num_strikes == 0 for r in s.requests.values())
    assert not s.failures._marked
