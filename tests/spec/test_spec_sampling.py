"""Speculative decoding keeps what sampling promises (docs/spec_decode.md): a seeded
request's tokens are the ones it gets without drafts (its noise is a pure function of
seed and output position, and verification is the coupled rejection rule), with
penalties, min_tokens and logprobs seen at each verify row as if the drafts before it
were accepted; a stop token among the drafts ends the answer there; the worker runs
from its own computed count and refuses a scheduler count it cannot explain."""

from __future__ import annotations

import pytest

from shared.types import (CachedRequestData, FinishReason, NewRequestData, SamplingParams,
                          SchedulerOutput)
from tests.spec.conftest import METHODS, make_runner, spec_json
from tests.spec.engine_loop import run
from tests.spec.test_spec_exact import PROMPTS
from worker_svc.step_check import StepError


def seeded(i: int) -> SamplingParams:
    """Seeded, with penalties on every other request; cold (this tiny random model's
    logits are nearly flat: warmer, no draft would ever be right)."""
    penalties = dict(frequency_penalty=0.05, presence_penalty=0.05,
                     repetition_penalty=1.02) if i % 2 else {}
    return SamplingParams(temperature=0.01, top_p=0.95, top_k=50, seed=100 + i,
                          max_tokens=32, ignore_eos=True, min_tokens=4 + i, logprobs=2,
                          **penalties)


@pytest.fixture(scope="module")
def plain(target_dir):
    return make_runner(target_dir)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_with_penalties_gives_the_tokens_it_gives_without_drafts(
        plain, target_dir, draft_dir, method, async_scheduling):
    params = [seeded(i) for i in range(len(PROMPTS))]
    runner = make_runner(target_dir, spec_json(method, 4, draft_dir))
    logprobs: dict[str, dict] = {}

    def collect(tag):
        return lambda out: logprobs.setdefault(tag, {}).setdefault(out.req_id, []).extend(
            out.new_logprobs)
    got, _, sched = run(runner, PROMPTS, params, async_scheduling=async_scheduling,
                        on_output=collect("spec"))
    want, _, _ = run(plain, PROMPTS, params, async_scheduling=async_scheduling,
                     on_output=collect("plain"))
    assert got == want
    st = sched.stats()
    assert st.spec_num_accepted_tokens > 0
    for req_id, lps in logprobs["spec"].items():
        base = logprobs["plain"][req_id]
        assert [x.token_id for x in lps] == [x.token_id for x in base] == want[req_id]
        assert [x.rank for x in lps] == [x.rank for x in base]
        for x, y in zip(lps, base):  # another batch shape: the same values, to rounding
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("method", METHODS)
def test_a_stop_token_among_the_drafts_ends_the_answer_there(plain, target_dir, draft_dir,
                                                             method):
    """Each request stops on a token its stream reaches mid-way (without drafts): with
    drafts the stop usually sits inside a verified run, and the tokens after it are
    never committed."""
    free, _, _ = run(plain, PROMPTS, [SamplingParams(temperature=0.0, max_tokens=40,
                                                     ignore_eos=True)] * len(PROMPTS))
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                             stop_token_ids=[free[f"r{i}"][12]]) for i in range(len(PROMPTS))]
    want, want_reasons, _ = run(plain, PROMPTS, params)
    got, reasons, sched = run(make_runner(target_dir, spec_json(method, 5, draft_dir)),
                              PROMPTS, params)
    assert got == want and reasons == want_reasons
    assert FinishReason.STOP in reasons.values()
    for i in range(len(PROMPTS)):
        stop = params[i].stop_token_ids[0]
        assert got[f"r{i}"].index(stop) == len(got[f"r{i}"]) - 1
    assert sched.num_free_blocks == sched.num_total_blocks - 1


# ------------------------------------------------------------- the sent count

def _step(step_id, req, computed, n, slots=0, blocks=()):
    return SchedulerOutput(
        step_id=step_id, scheduled_cached_reqs=CachedRequestData(
            req_ids=[req], resumed_from_preemption=[False], new_block_ids=[list(blocks)],
            num_computed_tokens=[computed]),
        num_scheduled_tokens={req: n}, total_num_scheduled_tokens=n,
        num_draft_slots={req: slots} if slots else {})


def test_the_worker_runs_from_its_own_count_and_refuses_one_it_cannot_explain(target_dir):
    """After a verify step that rejected r slots, the next step may count them (it was
    scheduled before the answer: async); one step later, or by any other amount, the
    scheduler's count is a desync and the step is refused before anything changes."""
    runner = make_runner(target_dir, spec_json("ngram", 4))
    # resent with one output token: the prompt's pattern continues after it, so prompt
    # lookup proposes 8, 9, 10, 11 (and this tiny model's argmax does not follow it)
    prompt = [7, 8, 9, 10, 11] * 6
    runner.execute(SchedulerOutput(step_id=0, scheduled_new_reqs=[NewRequestData(
        "a", prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
        [1, 2, 3, 4, 5], 0, output_token_ids=[7])], num_scheduled_tokens={"a": 30},
        total_num_scheduled_tokens=30))
    state = runner.requests["a"]
    out = runner.execute(_step(1, "a", 30, 5, slots=4))
    committed = len(out.sampled_token_ids[0])
    assert out.num_draft_tokens == [4]
    rejected = 4 - (committed - 1)
    assert rejected > 0
    assert state.last_rejection == (1, rejected) and state.num_computed_tokens == 30 + committed
    own = state.num_computed_tokens
    before = (list(state.token_ids), own)
    with pytest.raises(StepError, match="this worker holds"):  # not what it rejected
        runner.execute(_step(2, "a", own + rejected + 1, 1))
    assert (list(state.token_ids), state.num_computed_tokens) == before
    # scheduled before step 1's answer: it counts step 1's slots as accepted
    runner.execute(_step(2, "a", own + rejected, 1))
    assert state.num_computed_tokens == own + 1
    with pytest.raises(StepError, match="this worker holds"):  # step 3: no excuse left
        runner.execute(_step(3, "a", state.num_computed_tokens + 1, 1))
    runner.execute(SchedulerOutput(step_id=4, finished_req_ids={"a"}))
    assert not runner.requests
