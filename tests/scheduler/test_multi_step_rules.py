"""Multi-step decode (num_scheduler_steps > 1, docs/scheduling.md): a step of decodes
alone, with nothing waiting, runs several forward passes; everything else is the one
pass of "schedule(): two passes". The random workloads of test_properties cover it too."""

import pytest

from scheduler_svc.core import ConfigError
from shared.types import FinishReason
from tests.scheduler.helpers import (
    EOS, FakeWorker, check_invariants, drive, drive_async, make_request, make_scheduler,
    serve_five_in_a_small_pool,
)


def _decoding(steps=4, num_blocks=64, **config):
    """A scheduler whose two requests have prefilled and sampled their first token."""
    s = make_scheduler(num_blocks=num_blocks, num_scheduler_steps=steps, **config)
    w = FakeWorker()
    for r in ("a", "b"):
        s.add_request(make_request(r, 10, max_tokens=20))
    so = s.schedule()
    assert so.num_steps == 1  # prefill: one pass
    s.update_from_output(so, w.execute(so))
    return s, w


def test_a_step_of_decodes_with_nothing_waiting_runs_several_passes():
    s, w = _decoding(steps=4)
    so = s.schedule()
    assert so.num_steps == 4
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}  # the budget is per pass
    assert so.total_num_scheduled_tokens == 2
    a = s.requests["a"]
    # positions 10..13 computed; the last three tokens are placeholders until the answer
    assert (a.num_computed_tokens, a.num_output_placeholders, a.gap) == (14, 3, 0)
    assert len(s.get_block_ids("a")) == 1 and s.kv.blocks_needed(a, 14) == 0
    check_invariants(s, so)
    outs = s.update_from_output(so, w.execute(so))
    assert [o.new_token_ids for o in outs] == [[1011, 1012, 1013, 1014]] * 2
    assert (a.num_tokens, a.num_output_placeholders, a.gap) == (15, 0, 1)


def test_a_waiting_request_gets_a_one_pass_step():
    s, w = _decoding(steps=4)
    s.add_request(make_request("c", 5))
    so = s.schedule()
    assert so.num_steps == 1 and set(so.num_scheduled_tokens) == {"a", "b", "c"}
    s.update_from_output(so, w.execute(so))
    assert s.schedule().num_steps == 4  # c decodes too now


def test_passes_stop_at_the_first_request_to_reach_max_tokens():
    s = make_scheduler(num_scheduler_steps=8)
    w = FakeWorker()
    s.add_request(make_request("short", 10, max_tokens=3))
    s.add_request(make_request("long", 10, max_tokens=30))
    so = s.schedule()
    s.update_from_output(so, w.execute(so))
    so = s.schedule()
    assert so.num_steps == 2  # "short" may sample 2 more, never a token past max_tokens
    outs = {o.req_id: o for o in s.update_from_output(so, w.execute(so))}
    assert outs["short"].finish_reason == FinishReason.LENGTH
    assert len(s.requests["long"].output_token_ids) == 3


def test_passes_never_reach_past_max_model_len():
    s = make_scheduler(num_scheduler_steps=8, max_model_len=14)
    w = FakeWorker()
    s.add_request(make_request("a", 10, max_tokens=100))
    so = s.schedule()
    s.update_from_output(so, w.execute(so))
    so = s.schedule()
    assert so.num_steps == 3  # positions 10, 11, 12: the 14th token is sampled, not computed
    (out,) = s.update_from_output(so, w.execute(so))
    assert out.finish_reason == FinishReason.LENGTH and len(out.new_token_ids) == 3


def test_without_blocks_for_every_pass_it_runs_one_and_preempts_nobody():
    # 2 requests x 10 prompt tokens, blocks of 4: 3 blocks each for 11 tokens; 4 passes
    # need a 4th each, and only one is free
    s, w = _decoding(steps=4, num_blocks=1 + 7, block_size=4, max_model_len=24)
    assert s.num_free_blocks == 1
    so = s.schedule()
    assert so.num_steps == 1 and not so.preempted_req_ids
    check_invariants(s, so)


def _stopping_at(pos_of_eos, steps=5, **sampling):
    """One request decoding with `steps` passes a step; greedy EOS at pos_of_eos."""
    def token(req_id, pos):
        return EOS if pos == pos_of_eos else 1000 + pos
    s = make_scheduler(num_scheduler_steps=steps)
    w = FakeWorker(token)
    s.add_request(make_request("a", 10, max_tokens=20, **sampling))
    so = s.schedule()
    s.update_from_output(so, w.execute(so))
    return s, w


def test_the_worker_stops_a_request_at_its_stop_token_and_answers_short():
    s, w = _stopping_at(12)
    so = s.schedule()
    assert so.num_steps == 5
    mro = w.execute(so)
    assert mro.sampled_token_ids == [[1011, EOS]] and w.passes == {"a": 2}
    (out,) = s.update_from_output(so, mro)
    assert out.new_token_ids == [1011, EOS] and out.finish_reason == FinishReason.STOP
    assert s.num_free_blocks == s.num_total_blocks - 1
    assert s.schedule().finished_req_ids == {"a"}


def test_a_full_answer_with_a_stop_in_the_middle_has_the_tokens_after_it_dropped():
    s, w = _stopping_at(12)
    so = s.schedule()
    mro = w.execute(so)
    mro.sampled_token_ids = [[1011, EOS, 1013, 1014, 1015]]  # a worker that ran every pass
    (out,) = s.update_from_output(so, mro)
    assert out.new_token_ids == [1011, EOS] and out.finish_reason == FinishReason.STOP


@pytest.mark.parametrize("sampled, sampling", [
    ([1011], {}),                      # short, and no stop in it
    ([EOS, 1012], {}),                 # the stop is not its last token
    ([1011, EOS], {"ignore_eos": True}),  # EOS does not stop this request
    ([1011, EOS], {"min_tokens": 5}),  # nor before min_tokens are out
])
def test_a_short_answer_must_end_on_the_requests_first_stop(sampled, sampling):
    s, w = _stopping_at(12, **sampling)
    so = s.schedule()
    mro = w.execute(so)
    mro.sampled_token_ids = [sampled]
    a = s.requests["a"]
    before = (a.num_tokens, a.num_output_placeholders, a.status)
    with pytest.raises(ValueError, match=f"sampled {len(sampled)} tokens"):
        s.update_from_output(so, mro)
    assert (a.num_tokens, a.num_output_placeholders, a.status) == before


def test_a_step_scheduled_behind_a_stop_is_answered_without_the_stopped_request():
    s = make_scheduler(num_scheduler_steps=5, async_scheduling=True)
    w = FakeWorker(lambda req_id, pos: EOS if (req_id, pos) == ("a", 12) else 1000 + pos)
    s.add_request(make_request("a", 10, max_tokens=20))
    s.add_request(make_request("b", 10, max_tokens=20))
    so = s.schedule()
    s.update_from_output(so, w.execute(so))
    first = s.schedule()
    second = s.schedule()  # async: scheduled before the first's answer, "a" in both
    assert first.num_steps == second.num_steps == 5 and "a" in second.num_scheduled_tokens
    mro1, mro2 = w.execute(first), w.execute(second)
    assert w.passes == {"a": 0, "b": 5}  # the worker skipped "a" in the second
    assert mro2.sampled_token_ids[mro2.req_ids.index("a")] == []
    outs = {o.req_id: o for o in s.update_from_output(first, mro1)}
    assert outs["a"].new_token_ids == [1011, EOS]
    assert outs["a"].finish_reason == FinishReason.STOP
    outs = {o.req_id: o for o in s.update_from_output(second, mro2)}
    assert set(outs) == {"b"} and len(s.requests["b"].output_token_ids) == 11
    check_invariants(s)


def test_an_empty_answer_for_a_request_that_did_not_stop_is_refused():
    s, w = _decoding(steps=1)
    so = s.schedule()
    mro = w.execute(so)
    mro.sampled_token_ids[0] = []
    with pytest.raises(ValueError, match="sampled 0 tokens"):
        s.update_from_output(so, mro)


@pytest.mark.parametrize("driver", [drive, drive_async])
def test_multi_step_output_equals_one_pass_output(driver):
    async_ = driver is drive_async
    want, one_pass = serve_five_in_a_small_pool(driver, async_scheduling=async_)
    got, multi = serve_five_in_a_small_pool(driver, async_scheduling=async_,
                                            num_scheduler_steps=6)
    assert got == want
    assert multi.num_steps < one_pass.num_steps and multi.num_preemptions_total > 0


@pytest.mark.parametrize("tokens", [3, 1, 0])
def test_a_worker_that_samples_other_than_a_token_a_pass_is_refused(tokens):
    s, w = _decoding(steps=2)
    so = s.schedule()
    mro = w.execute(so)
    mro.sampled_token_ids[0] = [7] * tokens
    before = (s.requests["a"].num_tokens, s.requests["a"].num_output_placeholders)
    with pytest.raises(ValueError, match=f"sampled {tokens} tokens .* ran 2 forward pass"):
        s.update_from_output(so, mro)
    assert (s.requests["a"].num_tokens, s.requests["a"].num_output_placeholders) == before


@pytest.mark.parametrize("steps", [0, 65, True, 2.0])
def test_num_scheduler_steps_is_validated(steps):
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        make_scheduler(num_scheduler_steps=steps)
