"""A request's token limits (shared/request_limits.py), stated once: the scheduler's
door and the worker's step check refuse the same prompts with the same sentence, the
core behind the door asserts the same sentence, and all accept the same ones."""

from __future__ import annotations

import pytest

from scheduler_svc.engine import Engine
from shared.request_limits import token_ids_problem
from shared.types import (InvalidRequestError, ModelInfo, NewRequestData, SamplingParams,
                          SchedulerOutput)
from tests.scheduler.helpers import make_request, make_scheduler
from worker_svc.step_check import check_step

MAX_LEN, VOCAB = 64, 500


def test_a_request_needs_one_token_and_room_for_one_output_token():
    assert "empty" in token_ids_problem([], MAX_LEN)
    assert "leaves no room" in token_ids_problem([1] * MAX_LEN, MAX_LEN)
    assert token_ids_problem([1] * (MAX_LEN - 1), MAX_LEN) is None


def test_ids_outside_the_vocabulary_and_a_max_tokens_past_the_context_are_refused():
    assert "token id 500 is outside the vocabulary [0, 500)" in \
        token_ids_problem([1, 500], MAX_LEN, VOCAB)
    assert "outside the vocabulary" in token_ids_problem([-1], MAX_LEN, VOCAB)
    assert token_ids_problem([1, 500], MAX_LEN) is None  # vocabulary unknown: not checked
    assert "exceeds max_model_len" in token_ids_problem([1] * 60, MAX_LEN, VOCAB, max_tokens=5)
    assert token_ids_problem([1] * 60, MAX_LEN, VOCAB, max_tokens=4) is None


def door_problem(prompt):
    info = ModelInfo("m", VOCAB, MAX_LEN, [2], 1, 1, 1, "float32", 64, 16)
    engine = Engine(make_scheduler(max_model_len=MAX_LEN), None, info, MAX_LEN)
    try:
        engine.check(make_request("r", prompt, max_tokens=1))
    except InvalidRequestError as e:
        return str(e)
    return None


def core_problem(prompt):
    try:
        make_scheduler(max_model_len=MAX_LEN).add_request(make_request("r", prompt))
    except AssertionError as e:  # validated at the door: the core only asserts
        return str(e)
    return None


def worker_problem(prompt):
    new = NewRequestData("r", prompt, SamplingParams(max_tokens=1), [1, 2, 3, 4], 0)
    step = SchedulerOutput(step_id=0, scheduled_new_reqs=[new],
                           num_scheduled_tokens={"r": max(len(prompt), 1)},
                           total_num_scheduled_tokens=max(len(prompt), 1))
    try:
        check_step(step, {}, vocab_size=VOCAB, max_model_len=MAX_LEN, num_blocks=16,
                   block_size=16)
    except InvalidRequestError as e:
        return str(e)
    return None


@pytest.mark.parametrize("prompt", [[], [1] * MAX_LEN, [3, 7], [1] * (MAX_LEN - 1)])
def test_door_core_and_worker_agree_on_what_a_valid_prompt_is(prompt):
    expected = token_ids_problem(prompt, MAX_LEN)
    door, core, worker = door_problem(prompt), core_problem(prompt), worker_problem(prompt)
    if expected is None:
        assert door is core is worker is None
    else:
        assert door == core == expected
        assert worker == f"request 'r': {expected}"
