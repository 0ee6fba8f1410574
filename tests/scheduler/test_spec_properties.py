"""Speculative decoding under random workloads and configurations (docs/spec_decode.md):
the real scheduler against SpecWorker, which accepts a random prefix of each
request's draft slots. After every schedule and every answer: the invariants of
docs/scheduling.md (helpers.check_invariants), computed tokens = committed +
placeholders (check_spec_counters), and every cached hash covers KV of committed
tokens only (check_prefix_cache_holds_written_kv); after the drain no block is held;
and every request's greedy stream equals decoding without a scheduler and the
no-speculation run of the same workload, token for token. Async on and off, small
pools (preemption), chunked prefill with a long-prefill cap, multi-step decode,
priority, prefix-cache hits, aborts, disable_by_batch_size."""

import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_svc.core import Request, Scheduler, SchedulerConfig
from shared.speculative_config import SpeculativeConfig
from shared.types import FinishReason, SamplingParams
from tests.scheduler.helpers import EOS, check_invariants, check_prefix_cache_holds_written_kv
from tests.scheduler.spec_helpers import (SpecWorker, check_spec_counters, expected_stream,
                                          prefix_model)

SPEC_SETTINGS = settings(
    max_examples=int(os.environ.get("SPEC_PROP_EXAMPLES", "200")), deadline=None,
    derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 80))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 64))
    if not chunked:
        budget = max(budget, max_model_len)
    need = -(-(max_model_len - 1) // block_size)
    num_blocks = 1 + need + draw(st.sampled_from([0, 1, 3, need]))  # tight pools: preemption
    spec = SpeculativeConfig("ngram", draw(st.integers(1, 5)), 1, 3,
                             disable_by_batch_size=draw(st.sampled_from([None, None, 2, 2, 3])))
    cfg = dict(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=max_model_len, block_size=block_size,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 2, 9])) if chunked else 0,
        policy=draw(st.sampled_from(["fcfs", "fcfs", "priority"])),
        enable_chunked_prefill=chunked, enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()), hash_seed="spec-prop",
        num_scheduler_steps=draw(st.sampled_from([1, 3, 3])))
    worker = dict(seed=draw(st.integers(0, 1000)), p_good=draw(st.sampled_from([0.0, 0.6, 0.8, 0.9, 1.0])),
                  p_short=draw(st.sampled_from([0.0, 0.3])))
    return cfg, spec, num_blocks, worker


@st.composite
def workloads(draw, max_model_len):
    shared = draw(st.lists(st.integers(10, 49), min_size=1, max_size=max_model_len - 1))
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, max_model_len - 1))
        prefix = shared[:draw(st.integers(0, length))]
        prompt = prefix + [100 + i] * (length - len(prefix))
        max_tokens = draw(st.integers(1, 24))
        reqs.append(dict(
            req_id=f"r{i}", prompt=prompt, arrival=float(i), priority=draw(st.integers(0, 2)),
            salt=draw(st.sampled_from([None, "t1"])),
            params=dict(max_tokens=max_tokens,
                        min_tokens=draw(st.integers(0, min(3, max_tokens))),
                        ignore_eos=draw(st.booleans()),
                        stop_token_ids=draw(st.lists(st.integers(10, 49), max_size=1))),
            arrive=draw(st.integers(0, 8)), abort_at=draw(st.sampled_from([None] * 4 + [3, 9]))))
    return reqs, draw(st.sampled_from([5, 11, 1000]))


def serve(cfg: dict, spec, num_blocks: int, reqs, model, worker_args):
    """Run the workload to the end; check everything after every step. Returns the
    scheduler, each request's outputs, the worker and the steps."""
    config = SchedulerConfig(**cfg, speculative_config=spec)
    sched = Scheduler(config, num_blocks)
    worker = SpecWorker(model, config.block_size, config.max_model_len,
                        salts={r["req_id"]: r["salt"] for r in reqs}, **worker_args)
    requests = {r["req_id"]: Request(r["req_id"], r["prompt"], SamplingParams(**r["params"]),
                                     [EOS], r["arrival"], r["priority"], r["salt"])
                for r in reqs}
    outputs: dict[str, list] = {}
    steps: dict = {}
    base: dict[str, int] = {}
    in_flight: list = []
    depth = 2 if config.async_scheduling else 1

    def apply(so, mro):
        entries = dict(sched.in_flight.get(so.step_id, {}))
        for out in sched.update_from_output(so, mro):
            outputs.setdefault(out.req_id, []).append(out)
        for req_id, entry in entries.items():
            request = sched.requests.get(req_id)
            if request is not None and request.num_preemptions == entry.num_preemptions:
                base[req_id] = worker.true_after[so.step_id][req_id]
        check_invariants(sched)
        check_spec_counters(sched, base, steps)
        if config.enable_prefix_caching:
            check_prefix_cache_holds_written_kv(sched, worker)

    for step in range(3000):
        for r in reqs:
            if r["arrive"] == step:
                sched.add_request(requests[r["req_id"]])
            if r["abort_at"] == step:
                for out in sched.abort_requests([r["req_id"]]):
                    outputs.setdefault(out.req_id, []).append(out)
        if step > 8 and not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        steps[so.step_id] = so
        for new in so.scheduled_new_reqs:
            base[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, resumed, sent in zip(cached.req_ids, cached.resumed_from_preemption,
                                         cached.num_computed_tokens):
            if resumed:
                base[req_id] = sent
        check_invariants(sched, so)
        check_spec_counters(sched, base, steps)
        in_flight.append((so, worker.execute(so, so.num_draft_slots)))
        if len(in_flight) >= depth:
            apply(*in_flight.pop(0))
    else:  # FCFS ends every request when the pool holds one of maximum length
        assert cfg["policy"] == "priority", "the workload did not end"
    if cfg["policy"] == "priority":  # priority promises no finish; end the rest
        sched.abort_requests(list(sched.requests))
    for so, mro in in_flight:
        apply(so, mro)
    return sched, outputs, worker, steps


def streams(outputs) -> dict[str, tuple[list[int], FinishReason]]:
    return {r: ([t for o in outs for t in o.new_token_ids], outs[-1].finish_reason)
            for r, outs in outputs.items()}


@SPEC_SETTINGS
@given(data=st.data())
def test_draft_slots_keep_every_invariant_and_every_token(data):
    cfg, spec, num_blocks, worker_args = data.draw(configs())
    reqs, eos_every = data.draw(workloads(cfg["max_model_len"]))
    model = prefix_model(eos_every)
    sched, outputs, worker, steps = serve(cfg, spec, num_blocks, reqs, model, worker_args)
    stats = sched.stats()
    event(f"drafts accepted: {stats.spec_num_accepted_tokens > 0}")
    event(f"drafts rejected: {stats.spec_num_accepted_tokens < stats.spec_num_draft_slots}")
    event(f"preempted: {stats.num_preemptions_total > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"multi-step ran: {any(so.num_steps > 1 for so in steps.values())}")
    assert not sched.has_unfinished_requests() and not sched.in_flight
    check_invariants(sched)
    assert sched.num_free_blocks == sched.num_total_blocks - 1  # no leaks
    assert stats.spec_num_accepted_tokens == worker.accepted
    assert stats.spec_num_draft_tokens == worker.proposed  # vLLM's count: what was proposed
    plain, plain_outputs, _, _ = serve(cfg, None, num_blocks, reqs, model, worker_args)
    got, without = streams(outputs), streams(plain_outputs)
    for r in reqs:
        want = expected_stream(model, r["prompt"], SamplingParams(**r["params"]),
                               cfg["max_model_len"])
        for run in (got, without):
            tokens, reason = run[r["req_id"]]
            if reason is FinishReason.ABORT:  # aborted at a step: a prefix, no more
                assert tokens == want[:len(tokens)]
            else:
                assert tokens == want
        if FinishReason.ABORT not in (got[r["req_id"]][1], without[r["req_id"]][1]):
            assert got[r["req_id"]] == without[r["req_id"]]
