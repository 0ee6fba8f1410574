"""update_from_output(): stops, finishing, outputs, and rejection of bad worker output."""

import pytest

from scheduler_svc.core import WorkerOutputError
from shared.types import FinishReason, ModelRunnerOutput, TokenLogprobs
from tests.scheduler.helpers import (EOS, FakeWorker, check_invariants, drive, make_request,
                                     make_scheduler)


def run(req, script, **config):
    """Serve one request whose sampled tokens follow `script`; returns its outputs."""
    s = make_scheduler(**config)
    s.add_request(req)
    prompt_len = req.num_prompt_tokens
    w = FakeWorker(lambda req_id, pos: script[pos - prompt_len])
    outs = []
    while s.has_unfinished_requests():
        so = s.schedule()
        outs += s.update_from_output(so, w.execute(so))
        check_invariants(s)
    assert s.num_free_blocks == s.num_total_blocks - 1
    return s, outs


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_eos_stops_the_request_and_is_its_last_token():
    _, outs = run(make_request("a", 5, max_tokens=10), [7, 8, EOS, 9, 9])
    assert tokens(outs) == [7, 8, EOS]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_token_id == EOS


def test_ignore_eos_keeps_generating_until_max_tokens():
    _, outs = run(make_request("a", 5, max_tokens=4, ignore_eos=True), [EOS] * 10)
    assert tokens(outs) == [EOS] * 4 and outs[-1].finish_reason == FinishReason.LENGTH


def test_stop_token_id_stops_and_is_reported():
    _, outs = run(make_request("a", 5, max_tokens=10, stop_token_ids=[42]), [7, 42, 8])
    assert tokens(outs) == [7, 42]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_token_id == 42


def test_max_tokens_stops_with_length():
    _, outs = run(make_request("a", 5, max_tokens=3), [7] * 10)
    assert tokens(outs) == [7, 7, 7] and outs[-1].finish_reason == FinishReason.LENGTH
    assert outs[-1].stop_token_id is None


def test_max_model_len_stops_with_length():
    _, outs = run(make_request("a", 30, max_tokens=100), [7] * 100, max_model_len=32)
    assert len(tokens(outs)) == 2 and outs[-1].finish_reason == FinishReason.LENGTH


def test_min_tokens_suppresses_stops_until_reached():
    _, outs = run(make_request("a", 5, max_tokens=10, min_tokens=3, stop_token_ids=[42]),
                  [EOS, 42, EOS, 8])
    assert tokens(outs) == [EOS, 42, EOS]
    assert outs[-1].finish_reason == FinishReason.STOP


def test_stop_token_wins_over_length_on_the_last_allowed_token():
    _, outs = run(make_request("a", 5, max_tokens=2), [7, EOS])
    assert outs[-1].finish_reason == FinishReason.STOP


def test_finished_request_frees_blocks_and_is_reported_in_next_step():
    s = make_scheduler()
    w = FakeWorker()
    s.add_request(make_request("a", 40, max_tokens=1))
    so = s.schedule()
    (out,) = s.update_from_output(so, w.execute(so))
    assert out.finished and s.num_free_blocks == s.num_total_blocks - 1
    assert s.schedule().finished_req_ids == {"a"}
    assert s.schedule().finished_req_ids == set()


def test_logprobs_pass_through_to_the_request_output():
    s = make_scheduler()
    w = FakeWorker()
    s.add_request(make_request("a", 4, max_tokens=1))
    so = s.schedule()
    mro = w.execute(so)
    lp = TokenLogprobs(token_id=mro.sampled_token_ids[0][0], logprob=-0.5, rank=1)
    mro.logprobs = [[lp]]
    (out,) = s.update_from_output(so, mro)
    assert out.new_logprobs == [lp]


def test_bad_worker_output_raises_and_changes_nothing():
    s = make_scheduler(max_num_batched_tokens=16)
    w = FakeWorker()
    s.add_request(make_request("a", 40))
    so = s.schedule()  # a non-final chunk: samples nothing
    with pytest.raises(ValueError, match="did not reach the end"):
        s.update_from_output(so, ModelRunnerOutput(so.step_id, ["a"], [[5]]))
    with pytest.raises(ValueError, match="not in step"):
        s.update_from_output(so, ModelRunnerOutput(so.step_id, ["zz"], [[]]))
    with pytest.raises(ValueError, match="step"):
        s.update_from_output(so, ModelRunnerOutput(so.step_id + 7, ["a"], [[]]))
    assert s.requests["a"].output_token_ids == []
    assert s.update_from_output(so, w.execute(so)) == []
    with pytest.raises(ValueError, match="not in flight"):
        s.update_from_output(so, w.execute(so))  # applied twice


def test_an_empty_step_needs_no_update_and_accepts_one():
    s = make_scheduler()
    w = FakeWorker()
    for _ in range(3):  # more empty steps than may be in flight
        s.schedule()
    so = s.schedule()
    assert s.update_from_output(so, w.execute(so)) == []


def test_a_disagreeing_answer_names_both_sides_tokens_and_the_request_can_be_recomputed():
    s = make_scheduler()
    w = FakeWorker()
    s.add_request(make_request("a", 5, max_tokens=4))
    so = s.schedule()
    s.update_from_output(so, w.execute(so))  # one token out: 1005
    so = s.schedule()
    mro = w.execute(so)
    mro.sampled_token_ids = [[1006, 1007]]  # two tokens from one pass
    with pytest.raises(WorkerOutputError) as caught:
        s.update_from_output(so, mro)
    assert caught.value.sides == {"a": {"worker": [1006, 1007], "scheduler_output_tail": [1005],
                                        "scheduler_num_output": 1, "scheduled_passes": 1}}
    # the engine's recovery: the worker forgets, the scheduler replays its own tokens
    s.requeue_all_for_recompute()
    outs = drive(s, FakeWorker())
    assert [t for o in outs["a"] for t in o.new_token_ids] == [1006, 1007, 1008]
    assert s.num_free_blocks == s.num_total_blocks - 1
