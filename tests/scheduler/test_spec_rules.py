"""Speculative decoding's rules in the scheduler (docs/spec_decode.md), one test each:
draft slots in the gap, counted in the budget, given KV slots, never past
max_model_len or max_tokens; the answer rolls rejected slots back (under async
scheduling, placeholders too); the prefix cache registers committed KV only;
preemption drops drafts; chunked prefill, priority and multi-step compose with it;
disable_by_batch_size turns it off per step; a wrong answer is refused."""

import pytest

from scheduler_svc.core import ConfigError, WorkerOutputError
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.spec_slots import committed_kv_end
from shared.speculative_config import SpeculativeConfig
from shared.types import FinishReason, ModelRunnerOutput
from tests.scheduler.helpers import (check_invariants, check_prefix_cache_holds_written_kv,
                                     make_request, make_scheduler)
from tests.scheduler.spec_helpers import SpecWorker, expected_stream, prefix_model


def spec_scheduler(k=3, limit=None, **config):
    return make_scheduler(speculative_config=SpeculativeConfig(
        "ngram", k, 1, 3, disable_by_batch_size=limit), **config)


def answer(so, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    """The worker's answer: `tokens` per request (none for the others)."""
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(so.step_id, ids, [list(tokens.get(r, [])) for r in ids])


def decoding(s, ids=("a",), prompt=10, max_tokens=20, **sampling):
    """Admit the requests and apply their prefill: each has sampled its first token."""
    for r in ids:
        s.add_request(make_request(r, prompt, max_tokens=max_tokens, **sampling))
    so = s.schedule()
    assert not so.num_draft_slots  # a prefill gets no slots
    s.update_from_output(so, answer(so, {r: [7] for r in ids}))
    return [s.requests[r] for r in ids]


def counters(request):
    return (request.num_tokens, request.num_computed_tokens, request.num_output_placeholders)


# ------------------------------------------------------------------ the gap and the budget

def test_a_decode_gets_k_slots_counted_in_the_budget_and_given_kv():
    s = spec_scheduler(k=3, block_size=4, max_model_len=64)
    (a,) = decoding(s)
    so = s.schedule()
    assert so.num_draft_slots == {"a": 3}
    assert so.num_scheduled_tokens == {"a": 4} and so.total_num_scheduled_tokens == 4
    # positions 10 (the last token) and 11..13 (the slots) are computed; the slots are
    # placeholders until the answer, so the gap is what one decode leaves
    assert counters(a) == (11, 14, 3) and a.gap == 0
    assert len(s.get_block_ids("a")) == 4  # 14 positions in blocks of 4
    assert s.stats().step_num_draft_slots == 3
    check_invariants(s, so)


@pytest.mark.parametrize("committed, computed", [(1, 11), (2, 12), (4, 14)])
def test_the_answer_rolls_rejected_slots_back(committed, computed):
    s = spec_scheduler(k=3)
    (a,) = decoding(s)
    so = s.schedule()
    (out,) = s.update_from_output(so, answer(so, {"a": list(range(50, 50 + committed))}))
    assert out.new_token_ids == list(range(50, 50 + committed))
    assert counters(a) == (11 + committed, computed, 0) and a.gap == 1
    st = s.stats()
    assert (st.spec_num_drafts, st.spec_num_draft_slots, st.spec_num_accepted_tokens) == \
        (1, 3, committed - 1)
    assert st.spec_num_accepted_tokens_per_pos == tuple(int(i < committed - 1) for i in range(3))
    assert st.spec_acceptance_rate == (committed - 1) / 3
    so = s.schedule()  # the next step starts at the first position whose KV is not committed
    assert so.scheduled_cached_reqs.num_computed_tokens == [computed]


def test_the_acceptance_rate_counts_the_drafts_the_worker_proposed_as_vllm_does():
    """vLLM's num_drafts / num_draft_tokens count proposals: an n-gram that found one
    draft for three slots proposed one; one that found none proposed nothing (the
    request-step is no draft at all), though the slots are still taken back."""
    s = spec_scheduler(k=3)
    (a,) = decoding(s)
    for proposed, committed in ((1, 2), (0, 1), (3, 2)):
        so = s.schedule()
        assert so.num_draft_slots == {"a": 3}
        reply = answer(so, {"a": list(range(60, 60 + committed))})
        reply.num_draft_tokens = [proposed]
        s.update_from_output(so, reply)
    st = s.stats()
    assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_draft_slots,
            st.spec_num_accepted_tokens) == (2, 4, 9, 2)
    assert st.spec_num_accepted_tokens_per_pos == (2, 0, 0)
    assert st.spec_acceptance_rate == 2 / 4
    assert a.gap == 1 and not a.num_output_placeholders


def test_the_budget_left_gives_slots_in_running_order():
    s = spec_scheduler(k=4, max_num_seqs=4, max_num_batched_tokens=8)
    decoding(s, ("a", "b", "c"), prompt=2)
    so = s.schedule()  # 3 decode tokens first, then 5 left for slots: a 4, b 1, c none
    assert so.num_draft_slots == {"a": 4, "b": 1}
    assert so.num_scheduled_tokens == {"a": 5, "b": 2, "c": 1}
    assert so.total_num_scheduled_tokens == 8


def test_slots_never_reach_past_max_model_len():
    s = spec_scheduler(k=5, max_model_len=32)
    (a,) = decoding(s, prompt=29)  # 30 tokens; one more position may be computed
    so = s.schedule()
    assert so.num_draft_slots == {"a": 1}  # positions 29 and 30; 31 is never computed
    (out,) = s.update_from_output(so, answer(so, {"a": [60, 61]}))  # all accepted
    assert a.num_tokens == 32 and out.finish_reason is FinishReason.LENGTH


def test_a_request_one_token_from_max_model_len_gets_no_slot():
    s = spec_scheduler(k=5, max_model_len=32)
    decoding(s, prompt=30)
    so = s.schedule()
    assert not so.num_draft_slots and so.num_scheduled_tokens == {"a": 1}


@pytest.mark.parametrize("async_", [False, True])
def test_slots_never_reach_past_max_tokens(async_):
    s = spec_scheduler(k=5, async_scheduling=async_)
    s.add_request(make_request("a", 10, max_tokens=4))
    so1 = s.schedule()
    if async_:  # step 2 is scheduled before step 1's token: 1 of 4 is in flight
        so2 = s.schedule()
        assert so2.num_draft_slots == {"a": 2}  # 1 + 1 + 2 = 4 tokens at most
        a = s.requests["a"]
        assert len(a.output_token_ids) + a.num_output_placeholders == 4
        s.update_from_output(so1, answer(so1, {"a": [7]}))
        assert s.schedule().num_scheduled_tokens == {}  # all four may be in flight
        (out,) = s.update_from_output(so2, answer(so2, {"a": [8, 9, 10]}))
    else:
        s.update_from_output(so1, answer(so1, {"a": [7]}))
        so2 = s.schedule()
        assert so2.num_draft_slots == {"a": 2}
        (out,) = s.update_from_output(so2, answer(so2, {"a": [8, 9, 10]}))
    assert out.finish_reason is FinishReason.LENGTH and out.new_token_ids == [8, 9, 10]


def test_the_long_prefill_cap_bounds_a_decode_with_its_slots():
    s = spec_scheduler(k=5, long_prefill_token_threshold=3)
    decoding(s, ("a", "b"), prompt=2)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 3, "b": 3}


def test_a_running_prefill_chunk_comes_before_slots_and_gets_none():
    s = spec_scheduler(k=4, max_num_batched_tokens=16, max_model_len=128)
    decoding(s, ("a",))
    s.add_request(make_request("long", 60))
    so = s.schedule()  # a: 1 + 4 slots; long admitted with the 11 left
    assert so.num_scheduled_tokens == {"a": 5, "long": 11}
    s.update_from_output(so, answer(so, {"a": [8]}))
    so = s.schedule()  # long is RUNNING now: its chunk takes what a's token leaves
    assert so.num_scheduled_tokens == {"a": 1, "long": 15} and not so.num_draft_slots


# ------------------------------------------------------------------ KV: allocation, cache

def test_slots_take_only_free_blocks_and_never_preempt():
    # block 4: a holds 3 blocks (positions 0..11, the prompt is 10 + 1 token); 1 is free
    s = spec_scheduler(k=5, block_size=4, num_blocks=5, max_model_len=16)
    (a,) = decoding(s)
    assert s.num_free_blocks == 1
    so = s.schedule()  # positions 10..15 would need 1 more block: it fits, 16 does not
    assert so.num_draft_slots == {"a": 4} and not so.preempted_req_ids
    assert s.num_free_blocks == 0
    check_invariants(s, so)


def test_slots_shrink_to_the_blocks_left_without_preempting_anyone():
    s = spec_scheduler(k=5, block_size=4, num_blocks=7, max_model_len=24)
    decoding(s, ("a", "b"), prompt=9)  # each holds 3 blocks (positions 0..9 and its token)
    assert s.num_free_blocks == 0
    so = s.schedule()  # both fit their token in their last block, slots fill it: 2 each
    assert so.num_draft_slots == {"a": 2, "b": 2} and not so.preempted_req_ids


def test_a_step_that_preempts_gets_no_slots():
    s = spec_scheduler(k=3, block_size=4, num_blocks=7, max_model_len=24)
    decoding(s, ("a", "b"), prompt=12)  # each holds 3 full blocks: no free block
    so = s.schedule()  # a's next token needs a block: b is preempted
    assert so.preempted_req_ids == {"b"} and not so.num_draft_slots
    assert so.num_scheduled_tokens == {"a": 1}


def _serve_async(s, worker, outputs):
    """Two steps in flight until all ended; each answer checked for the prefix cache."""
    in_flight = []
    while s.has_unfinished_requests() or in_flight:
        if s.has_unfinished_requests() and len(in_flight) < 2:
            so = s.schedule()
            in_flight.append((so, worker.execute(so, so.num_draft_slots)))
            if len(in_flight) < 2 and s.has_unfinished_requests():
                continue
        so, mro = in_flight.pop(0)
        step = dict(s.in_flight.get(so.step_id, {}))
        for out in s.update_from_output(so, mro):
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
        check_prefix_cache_holds_written_kv(s, worker)
        for req_id, entry in step.items():  # the end it registers to is the worker's own
            request = s.requests.get(req_id)
            if request is not None:
                assert committed_kv_end(request, entry) == worker.true_after[so.step_id][req_id]


def test_only_blocks_of_committed_tokens_enter_the_prefix_cache():
    """Every cached block holds the KV of the tokens its hash names, though rejected
    drafts were written into blocks; a request with the same tokens then hits them
    and decodes exactly."""
    model = prefix_model()
    s = spec_scheduler(k=4, block_size=2, max_model_len=40, async_scheduling=True)
    worker = SpecWorker(model, 2, 40, seed=3, p_good=0.5, p_short=0.0)
    a = make_request("a", 6, max_tokens=12, ignore_eos=True)
    s.add_request(a)
    outputs: dict[str, list[int]] = {}
    _serve_async(s, worker, outputs)
    assert worker.accepted < worker.proposed and worker.accepted  # some rejected, some not
    assert len(s.kv.pool.cached) == (6 + 12 - 1) // 2  # every full block of committed KV
    again = make_request("b", a.prompt_token_ids + outputs["a"][:8], max_tokens=10,
                         ignore_eos=True)
    s.add_request(again)
    _serve_async(s, worker, outputs)
    assert again.num_cached_tokens == 12  # all but the last block (its last token is recomputed)
    assert outputs["b"] == expected_stream(model, again.prompt_token_ids,
                                           again.sampling_params, 40)


# ------------------------------------------------------------------ async, preemption

def test_async_a_step_scheduled_before_an_answer_counts_its_slots_as_accepted():
    s = spec_scheduler(k=3, async_scheduling=True)
    s.add_request(make_request("a", 10, max_tokens=30))
    a = s.requests["a"]
    so1 = s.schedule()  # prefill: samples one token, a placeholder
    so2 = s.schedule()  # position 10 (that token) + 3 slots
    assert so2.num_draft_slots == {"a": 3}
    assert counters(a) == (10, 14, 5)  # 1 + (1 + 3) tokens may be in flight
    s.update_from_output(so1, answer(so1, {"a": [7]}))
    assert counters(a) == (11, 14, 4)
    so3 = s.schedule()  # before step 2's answer: it counts step 2's slots as accepted
    assert so3.scheduled_cached_reqs.num_computed_tokens == [14]
    assert so3.num_draft_slots == {"a": 3} and counters(a) == (11, 18, 8)
    s.update_from_output(so2, answer(so2, {"a": [8, 9]}))  # 1 of 3 accepted: 2 back
    assert counters(a) == (13, 16, 4) and a.gap == 1
    s.update_from_output(so3, answer(so3, {"a": [10]}))  # the worker ran from 12
    assert counters(a) == (14, 13, 0) and a.gap == 1


def test_preemption_drops_the_drafts_of_a_step_in_flight():
    s = spec_scheduler(k=3, block_size=4, num_blocks=7, max_model_len=24,
                       async_scheduling=True)
    s.add_request(make_request("a", 9, max_tokens=10))
    s.add_request(make_request("b", 9, max_tokens=10))
    so1 = s.schedule()  # both prefill (3 blocks each, position 9 is their first token)
    so2 = s.schedule()  # one token each + slots in their last block
    assert so2.num_draft_slots == {"a": 2, "b": 2}
    s.update_from_output(so1, answer(so1, {"a": [7], "b": [7]}))
    so3 = s.schedule()  # a needs a fourth block: b, with slots in flight, is preempted
    assert so3.preempted_req_ids == {"b"}
    b = s.requests["b"]
    assert counters(b) == (10, 0, 0)  # its computed work and placeholders are gone
    s.update_from_output(so2, answer(so2, {"a": [8], "b": [8, 9]}))
    assert counters(b) == (12, 0, 0)  # the tokens it committed are kept, nothing rolls back
    assert b.output_token_ids == [7, 8, 9]
    check_invariants(s)


# ------------------------------------------------------------------ the per-step switch

def test_disable_by_batch_size_turns_slots_off_while_that_many_run():
    s = spec_scheduler(k=2, limit=3)
    decoding(s, ("a", "b", "c"), max_tokens=2)
    so = s.schedule()  # 3 running: no slots
    assert not so.num_draft_slots and so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    s.update_from_output(so, answer(so, {"a": [8], "b": [8], "c": [8]}))  # all at max_tokens
    decoding(s, ("d", "e"))
    so = s.schedule()
    assert so.num_draft_slots == {"d": 2, "e": 2}


def test_disable_by_batch_size_counts_the_waiting_requests_too():
    """vLLM's docs count enqueued requests: while a burst is being admitted its prompts
    get the budget, not the first arrivals' drafts."""
    s = spec_scheduler(k=2, limit=3, max_num_batched_tokens=16)
    decoding(s, ("a",))
    for r in ("w1", "w2"):
        s.add_request(make_request(r, 30))  # 2 prompts larger than the step's budget
    so = s.schedule()  # 1 running + 2 waiting: no slots, the budget goes to prefill
    assert not so.num_draft_slots and so.num_scheduled_tokens["a"] == 1
    assert sum(so.num_scheduled_tokens.values()) == 16


@pytest.mark.parametrize("limit, steps, slots", [(3, 1, {"a": 2, "b": 2}), (2, 4, {})])
def test_a_step_with_slots_is_one_pass_and_multi_step_runs_when_speculation_is_off(
        limit, steps, slots):
    s = spec_scheduler(k=2, limit=limit, num_scheduler_steps=4)
    decoding(s, ("a", "b"))
    so = s.schedule()  # a step of decodes with nothing waiting
    assert so.num_steps == steps and so.num_draft_slots == slots


def test_priority_composes_the_victim_of_pass_one_leaves_a_step_without_slots():
    s = spec_scheduler(k=3, block_size=4, num_blocks=7, max_model_len=24, policy="priority")
    s.add_request(make_request("low", 12, priority=5))
    s.add_request(make_request("high", 12, priority=0))
    so = s.schedule()
    s.update_from_output(so, answer(so, {"low": [7], "high": [7]}))
    so = s.schedule()  # the first to need a block preempts the least important
    assert so.preempted_req_ids == {"low"} and not so.num_draft_slots


# ------------------------------------------------------------------ the answer

def test_an_answer_with_more_tokens_than_slots_allow_is_refused_changing_nothing():
    s = spec_scheduler(k=2)
    (a,) = decoding(s)
    so = s.schedule()
    before = counters(a)
    with pytest.raises(WorkerOutputError, match="had 2 draft slot"):
        s.update_from_output(so, answer(so, {"a": [1, 2, 3, 4]}))
    assert counters(a) == before and so.step_id in s.in_flight
    s.update_from_output(so, answer(so, {"a": [1, 2, 3]}))  # the right one still applies


def test_an_empty_answer_for_a_running_request_with_slots_is_refused():
    s = spec_scheduler(k=2)
    decoding(s)
    so = s.schedule()
    with pytest.raises(WorkerOutputError):
        s.update_from_output(so, answer(so, {}))


def test_a_stop_among_accepted_drafts_ends_the_request_there():
    s = spec_scheduler(k=3)
    decoding(s)
    so = s.schedule()
    (out,) = s.update_from_output(so, answer(so, {"a": [8, 2]}))  # 2 is EOS
    assert out.finish_reason is FinishReason.STOP and out.new_token_ids == [8, 2]
    assert s.num_free_blocks == s.num_total_blocks - 1


def test_greedy_stream_equals_decoding_without_speculation():
    model = prefix_model(eos_every=29)
    s = spec_scheduler(k=4, block_size=4, num_blocks=14, max_model_len=48,
                       async_scheduling=True)
    worker = SpecWorker(model, 4, 48, seed=5, p_good=0.8)
    prompts = {r: [11 + i, 12, 13 + i] * (i + 2) for i, r in enumerate("abcd")}
    for r, prompt in prompts.items():
        s.add_request(make_request(r, prompt, max_tokens=30))
    got: dict[str, list[int]] = {}
    in_flight = []
    while s.has_unfinished_requests() or in_flight:
        if s.has_unfinished_requests() and len(in_flight) < 2:
            so = s.schedule()
            in_flight.append((so, worker.execute(so, so.num_draft_slots)))
            if len(in_flight) < 2 and s.has_unfinished_requests():
                continue
        for out in s.update_from_output(*in_flight.pop(0)):
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
    st = s.stats()
    assert st.num_preemptions_total > 0 and 0 < st.spec_num_accepted_tokens
    for r, prompt in prompts.items():
        params = make_request(r, prompt, max_tokens=30).sampling_params
        assert got[r] == expected_stream(model, prompt, params, 48)
    assert s.num_free_blocks == s.num_total_blocks - 1


def test_the_scheduler_takes_only_a_parsed_speculative_config():
    with pytest.raises(ConfigError, match="must be a SpeculativeConfig"):
        make_scheduler(speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_lost_worker_with_drafts_in_flight_is_recovered_exactly():
    """The workers are replaced while two steps with slots are in flight: their
    answers never come, every request is recomputed from the scheduler's tokens, and
    the streams are still exact."""
    model = prefix_model(eos_every=31)
    s = spec_scheduler(k=3, block_size=4, max_model_len=64, async_scheduling=True)
    prompts = {"a": [11, 12, 13] * 3, "b": [20, 21] * 5}
    for r, prompt in prompts.items():
        s.add_request(make_request(r, prompt, max_tokens=25))
    worker = SpecWorker(model, 4, 64, seed=2, p_good=0.8)
    got: dict[str, list[int]] = {}
    for _ in range(3):  # a few steps, then two in flight
        so = s.schedule()
        for out in s.update_from_output(so, worker.execute(so, so.num_draft_slots)):
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
    lost_slots = {}
    for _ in range(2):
        so = s.schedule()
        lost_slots.update(so.num_draft_slots)
        worker.execute(so, so.num_draft_slots)  # answers that are lost
    assert lost_slots and set(s.requeue_all_for_recompute()) == set(lost_slots)
    assert all(r.num_computed_tokens == r.num_output_placeholders == 0
               for r in s.requests.values())
    _serve_async(s, SpecWorker(model, 4, 64, seed=9, p_good=0.8), got)
    for r, prompt in prompts.items():
        params = make_request(r, prompt, max_tokens=25).sampling_params
        assert got[r] == expected_stream(model, prompt, params, 64)
    assert s.num_free_blocks == s.num_total_blocks - 1


def test_a_request_with_a_grammar_gets_slots_once_its_grammar_compiled():
    """The worker drafts and verifies under the grammar's mask (worker_svc/spec/), so a
    constrained request decodes with slots like any other, once it left its deferral."""
    from shared.structured.spec import StructuredOutputSpec
    s = spec_scheduler(k=3, block_size=4, max_model_len=64)
    s.add_request(make_request("g", 10, max_tokens=20,
                               structured_output=StructuredOutputSpec("regex", "[a-z]+")))
    s.add_request(make_request("u", 10, max_tokens=20))
    while s.requests["g"].status is not RequestStatus.RUNNING or \
            s.requests["u"].num_computed_tokens < 10:
        so = s.schedule()
        assert "g" not in so.num_draft_slots
        ids = list(so.num_scheduled_tokens)
        s.update_from_output(so, ModelRunnerOutput(
            so.step_id, ids, [[7] for _ in ids], grammars_ready=["g"]))
    so = s.schedule()
    assert so.num_draft_slots == {"g": 3, "u": 3}
