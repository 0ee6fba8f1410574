"""The stop rule (shared/stop_rule.py): one function set that both the scheduler and
the worker call, so their stop decisions cannot disagree."""

from __future__ import annotations

import pytest

from scheduler_svc.core import Scheduler
from shared.stop_rule import finish_reason, first_stop, is_stop, stop_ids
from shared.types import FinishReason, SamplingParams
from tests.scheduler.helpers import EOS, make_request, make_scheduler
from worker_svc.worker_request import WorkerRequest

CASES = [  # params, output tokens before the token 2 (EOS), does it stop
    (SamplingParams(), 0, True),
    (SamplingParams(ignore_eos=True), 0, False),
    (SamplingParams(min_tokens=3), 1, False),
    (SamplingParams(min_tokens=3), 2, True),
    (SamplingParams(stop_token_ids=[2], ignore_eos=True), 0, True),
]


def test_eos_counts_as_a_stop_id_unless_ignore_eos():
    assert stop_ids(SamplingParams(stop_token_ids=[7]), [EOS]) == {7, EOS}
    assert stop_ids(SamplingParams(stop_token_ids=[7], ignore_eos=True), [EOS]) == {7}


def test_min_tokens_holds_stops_back_until_that_many_tokens_are_out():
    ids = frozenset({EOS})
    assert not is_stop(EOS, 2, ids, 3)
    assert is_stop(EOS, 3, ids, 3)
    assert first_stop([EOS, 5, EOS], 0, ids, 3) == 2


def test_a_last_allowed_token_that_is_a_stop_token_is_reported_as_stop():
    ids = frozenset({EOS})
    assert finish_reason(EOS, 4, 10, ids, 0, max_tokens=4, max_model_len=100) is FinishReason.STOP
    assert finish_reason(5, 4, 10, ids, 0, max_tokens=4, max_model_len=100) is FinishReason.LENGTH
    assert finish_reason(5, 3, 100, ids, 0, max_tokens=4, max_model_len=100) is FinishReason.LENGTH
    assert finish_reason(5, 3, 99, ids, 0, max_tokens=4, max_model_len=100) is None


@pytest.mark.parametrize("params, outputs_before, stops", CASES)
def test_worker_and_scheduler_stop_on_the_same_token(params, outputs_before, stops):
    state = WorkerRequest("r", [5, 6] + [9] * outputs_before, 2, [], 0, params, 0, None)
    state.record_sampled(EOS, frozenset({EOS}))
    s = make_scheduler()
    request = make_request("r", [5, 6], params.max_tokens, min_tokens=params.min_tokens,
                           ignore_eos=params.ignore_eos, stop_token_ids=params.stop_token_ids)
    for _ in range(outputs_before):
        request.append_output_token(9)
    request.append_output_token(EOS)
    finished = s._check_stop(request, EOS) is not None
    assert state.stopped is stops and finished is stops
    request.output_token_ids.pop()
    assert Scheduler._stopped_short(request, [EOS]) is stops
