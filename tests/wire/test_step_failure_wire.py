"""A request that fails by itself, over the real Step stream (docs/resilience.md): a
real worker servicer on the tiny model and the real scheduler engine. A step that
raises travels as data: the poison request is failed with INTERNAL and its
exception, the others finish with the tokens of a run without it, with async
scheduling on and off. A request that kills the worker (its stream ends) is found
the same way, across reconnects, and a loop of losses is logged once per burst."""

from __future__ import annotations

import queue

import grpc
import pytest
from structlog.testing import capture_logs

from scheduler_svc.backoff import Backoff, BurstLog
from scheduler_svc.worker_group import WorkerGroup
from shared.wire.worker import runner_output_to_proto
from shared.types import ModelRunnerOutput
from tests.wire.conftest import start_wire_stack
from tests.wire.session_client import SessionClient
from worker_svc import fault_injection
from worker_svc.parallel import GroupLost

POISON = 4242
PROMPTS = {"ok0": [1, 504, 3209, 28, 253], "ok1": [1, 17, 912, 33, 7, 61, 2048]}
BAD = [1, 900, POISON, 31]
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def serve(stack, with_bad: bool) -> SessionClient:
    client = SessionClient(stack.engine_stub)
    client.add("ok0", PROMPTS["ok0"], **GREEDY)
    if with_bad:
        client.add("bad", BAD, **GREEDY)
    client.add("ok1", PROMPTS["ok1"], **GREEDY)
    client.wait_ended("ok0", "ok1", *(["bad"] if with_bad else []))
    client.close()
    return client


def pool_free(stack) -> bool:
    core = stack.scheduler_core
    return stack.engine.run_on_loop(
        lambda: not core.has_unfinished_requests()
        and core.num_free_blocks == core.num_total_blocks - 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_that_raises_fails_only_its_request_and_the_others_finish_equal(
        tiny_runner, monkeypatch, async_scheduling):
    stack = start_wire_stack(tiny_runner, async_scheduling=async_scheduling)
    try:
        reference = serve(stack, with_bad=False).tokens
        monkeypatch.setattr(tiny_runner, "before_step", fault_injection.before_step_hook(POISON))
        client = serve(stack, with_bad=True)
        assert {r: client.tokens[r] for r in PROMPTS} == reference
        rejection = client.rejected["bad"].status
        assert rejection.code == INTERNAL
        assert "alone, after retrying it once" in rejection.message
        assert f"InjectedFault: injected fault (GAPSERVE_FAULT_FAIL_ON_TOKEN={POISON})" \
            in rejection.message
        assert stack.engine.num_steps_failed == 3 and stack.engine.num_requests_failed == 1
        assert stack.engine.num_worker_reconnects == 0  # as data: the stream stayed up
        assert pool_free(stack)
    finally:
        stack.close()


def test_a_request_that_kills_the_worker_is_isolated_and_the_loss_loop_logs_once_per_burst(
        tiny_runner, monkeypatch):
    stack = start_wire_stack(tiny_runner, async_scheduling=True)
    try:
        reference = serve(stack, with_bad=False).tokens
        inject = fault_injection.FailOnToken(POISON)

        def die(step_id, states, num_scheduled):  # the group is lost: the stream ends
            try:
                inject.check(step_id, states, num_scheduled)
            except fault_injection.InjectedFault as e:
                raise GroupLost(str(e)) from None

        monkeypatch.setattr(tiny_runner, "before_step", die)
        with capture_logs() as logs:
            client = serve(stack, with_bad=True)
        assert {r: client.tokens[r] for r in PROMPTS} == reference
        rejection = client.rejected["bad"].status
        assert rejection.code == INTERNAL
        assert "died with this request in flight" in rejection.message
        # the loss, the retry with everyone, then bad alone: three reconnects; the first
        # two are one burst (no step applied between them), logged once
        assert stack.engine.num_worker_reconnects == 3
        lost = [e for e in logs if e["event"] == "worker_lost"]
        assert [e["losses_in_burst"] for e in lost] == [1, 1]
        assert [e["req_id"] for e in logs if e["event"] == "request_failed"] == ["bad"]
        assert pool_free(stack)
    finally:
        stack.close()


def test_backoff_doubles_to_its_cap_and_restarts_after_progress():
    backoff = Backoff(first_s=0.05, max_s=0.3)
    assert [backoff.next() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    backoff.reset()
    assert backoff.next() == 0.05


def test_a_burst_is_logged_once_then_at_most_once_an_interval_with_what_it_left_out():
    now = [0.0]
    burst = BurstLog(interval_s=30.0, clock=lambda: now[0])
    logged = []
    for t in (0.0, 1.0, 2.0, 29.0, 31.0, 32.0):
        now[0] = t
        logged.append(burst.event())
    assert logged == [1, None, None, None, 4, None]
    assert burst.end() == 6 and burst.event() == 1  # a new burst logs at once


def test_a_step_fails_when_any_tensor_parallel_rank_reports_an_error():
    group = WorkerGroup(["127.0.0.1:1", "127.0.0.1:2"])  # no call is made: answers below
    group._answers = [queue.SimpleQueue(), queue.SimpleQueue()]
    ok = ModelRunnerOutput(step_id=5, req_ids=["a"], sampled_token_ids=[[7]])
    group._answers[0].put(runner_output_to_proto(ok))
    group._answers[1].put(runner_output_to_proto(
        ModelRunnerOutput(step_id=5, error="RuntimeError: shape mismatch")))
    failed = group.collect()
    assert failed.step_id == 5 and failed.error == "rank 1: RuntimeError: shape mismatch"
    for box in group._answers:  # every rank fine: rank 0's tokens
        box.put(runner_output_to_proto(ok))
    assert group.collect().sampled_token_ids == [[7]]
