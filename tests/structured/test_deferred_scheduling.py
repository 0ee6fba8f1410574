"""The scheduler core's deferred state "grammar compiling" (core/grammar_wait.py): a
request with a grammar waits in its place while others are admitted past it, its
grammar is announced once, a worker's readiness admits it from that place, a failed
compile ends it with its reason, and a worker loss defers and re-announces it."""

from __future__ import annotations

import pytest

from scheduler_svc.core.request import RequestStatus
from shared.structured.spec import StructuredOutputSpec
from shared.types import ModelRunnerOutput
from tests.scheduler.helpers import make_request, make_scheduler

SPEC = StructuredOutputSpec("regex", "[a-z]+")


def grammar_request(req_id: str, **kw):
    return make_request(req_id, 8, structured_output=SPEC, temperature=0.0, **kw)


def answer(step, ready=(), errors=None) -> ModelRunnerOutput:
    """A worker's answer: a token for each request whose chunk samples."""
    ids = list(step.num_scheduled_tokens)
    return ModelRunnerOutput(step_id=step.step_id, req_ids=ids,
                             sampled_token_ids=[[7] for _ in ids],
                             grammars_ready=list(ready), grammar_errors=dict(errors or {}))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_compiling_request_keeps_its_place_while_others_are_admitted(policy):
    s = make_scheduler(policy=policy, max_num_seqs=2)
    s.add_request(grammar_request("g", arrival=1.0))
    s.add_request(make_request("a", 8, arrival=2.0))
    s.add_request(make_request("b", 8, arrival=3.0))
    step = s.schedule()
    assert [n.req_id for n in step.scheduled_new_reqs] == ["a", "b"]  # past the deferred one
    assert step.grammar_compiles == {"g": SPEC}  # announced once
    stats = s.stats()
    assert (stats.num_waiting, stats.num_waiting_not_ready) == (1, 1)
    s.update_from_output(step, answer(step))
    s.add_request(make_request("c", 8, arrival=4.0))
    s.abort_requests(["a"])  # a seat frees up: the deferred one is still not ready
    step = s.schedule()
    assert [n.req_id for n in step.scheduled_new_reqs] == ["c"]
    assert step.grammar_compiles == {}
    s.update_from_output(step, answer(step, ready=["g"]))
    assert s.stats().num_waiting_not_ready == 0
    s.add_request(make_request("d", 8, arrival=5.0))
    s.abort_requests(["b"])
    step = s.schedule()  # one seat: the grammar request goes first, from its own place
    assert [n.req_id for n in step.scheduled_new_reqs] == ["g"]
    assert step.scheduled_new_reqs[0].sampling_params.structured_output == SPEC


def test_a_spec_the_workers_compiled_before_is_not_deferred_again():
    s = make_scheduler()
    s.add_request(grammar_request("g1"))
    step = s.schedule()
    s.update_from_output(step, answer(step, ready=["g1"]))
    s.add_request(grammar_request("g2"))  # the same spec: rank 0's cache holds it
    step = s.schedule()
    assert sorted(step.num_scheduled_tokens) == ["g1", "g2"] and not step.grammar_compiles
    s.update_from_output(step, answer(step))
    s.requeue_all_for_recompute()  # a fresh worker holds nothing: both wait again
    assert s.schedule().grammar_compiles == {"g1": SPEC, "g2": SPEC}


def test_readiness_on_an_empty_step_is_applied():
    s = make_scheduler()
    s.add_request(grammar_request("g"))
    step = s.schedule()
    assert not step.num_scheduled_tokens and step.grammar_compiles == {"g": SPEC}
    assert s.update_from_output(step, answer(step, ready=["g"])) == []
    step = s.schedule()
    assert list(step.num_scheduled_tokens) == ["g"]


def test_a_failed_compile_ends_the_request_with_its_reason_and_frees_everything():
    s = make_scheduler()
    s.add_request(grammar_request("g"))
    step = s.schedule()
    s.update_from_output(step, answer(step, errors={"g": "invalid regex: boom"}))
    assert s.grammar.take_failures() == [("g", "invalid regex: boom")]
    assert not s.has_unfinished_requests() and len(s.waiting) == 0
    assert s.num_free_blocks == s.num_total_blocks - 1
    assert s.schedule().finished_req_ids == {"g"}  # the worker drops what it compiled


def test_an_abort_while_compiling_leaves_nothing_behind():
    s = make_scheduler()
    s.add_request(grammar_request("g"))
    s.schedule()
    s.abort_requests(["g"])
    stats = s.stats()
    assert (stats.num_waiting, stats.num_waiting_not_ready) == (0, 0)
    assert not s.grammar.needs_poll()
    assert s.schedule().grammar_compiles == {}


def test_a_worker_loss_defers_and_announces_the_grammar_again():
    s = make_scheduler()
    s.add_request(grammar_request("g"))
    step = s.schedule()
    s.update_from_output(step, answer(step, ready=["g"]))
    step = s.schedule()
    assert list(step.num_scheduled_tokens) == ["g"]
    s.update_from_output(step, answer(step))
    s.requeue_all_for_recompute()  # the new worker has compiled nothing
    step = s.schedule()
    assert not step.num_scheduled_tokens and step.grammar_compiles == {"g": SPEC}
    assert s.requests["g"].status is RequestStatus.PREEMPTED and s.requests["g"].deferred
    s.update_from_output(step, answer(step, ready=["g"]))
    step = s.schedule()
    assert list(step.num_scheduled_tokens) == ["g"]
    new = step.scheduled_new_reqs[0]  # resent whole, with its output for the replay
    assert new.output_token_ids == [7]
