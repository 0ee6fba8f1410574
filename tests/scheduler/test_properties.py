"""Random workloads under random configurations; the invariants of docs/scheduling.md are
checked after every step (helpers.check_invariants), and every request's output is
compared with what a correct server must return, token for token."""

import os
import zlib

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_svc.core import Request, Scheduler, SchedulerConfig
from shared.kv_window import max_blocks_per_request
from shared.types import FinishReason, ModelRunnerOutput, SamplingParams, SchedulerOutput
from tests.scheduler.helpers import (EOS, KVWorker, check_invariants,
                                     check_prefix_cache_holds_written_kv)

# Derandomized, so the suite is deterministic; SCHED_PROP_EXAMPLES=2000 for a deep run.
PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("SCHED_PROP_EXAMPLES", "80")), deadline=None,
    derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def token_at(req_id: str, pos: int, eos_every: int) -> int:
    h = zlib.crc32(f"{req_id}:{pos}".encode())
    return EOS if h % eos_every == 0 else 10 + h % 40


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 96))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 8))
    budget = draw(st.integers(max_num_seqs, 128))
    if not chunked:
        budget = max(budget, max_model_len)
    # a model whose every layer has this window: blocks behind it are freed, and the
    # pool need only hold one window and one chunk (shared/kv_window.py)
    window = draw(st.sampled_from([0, 0, 3, 9, 20]))
    window = window if window < max_model_len else 0
    need = max_blocks_per_request(max_model_len, block_size, window, budget)
    num_blocks = 1 + need + draw(st.sampled_from([0, 1, 2, need]))  # tight pools: preemption
    cfg = SchedulerConfig(sliding_window=window,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=max_model_len, block_size=block_size,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 17])) if chunked else 0,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_chunked_prefill=chunked, enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()), hash_seed="prop",
        num_scheduler_steps=draw(st.sampled_from([1, 1, 2, 5])))
    return cfg, num_blocks


@st.composite
def workloads(draw, max_model_len):
    prefixes = [draw(st.lists(st.integers(10, 60), min_size=1, max_size=max_model_len - 1))
                for _ in range(2)]
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        length = draw(st.integers(1, max_model_len - 1))
        shared = draw(st.integers(0, length))
        prefix = prefixes[i % 2][:shared]
        prompt = prefix + [100 + i] * (length - len(prefix))
        max_tokens = draw(st.integers(1, 24))
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=draw(st.integers(0, min(3, max_tokens))),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(10, 49), max_size=2)))
        reqs.append(dict(
            req=Request(f"r{i}", prompt, params, [EOS], float(i), draw(st.integers(0, 2)),
                        draw(st.sampled_from([None, "t1"]))),
            arrive=draw(st.integers(0, 10)),
            abort_at=draw(st.sampled_from([None, None, None, 2, 7, 15]))))
    return reqs, draw(st.sampled_from([3, 7, 1000]))


def expected_tokens(req: Request, eos_every: int, max_model_len: int) -> tuple[list[int], FinishReason]:
    out = []
    p = req.sampling_params
    pos = req.num_prompt_tokens
    while True:
        tok = token_at(req.req_id, pos, eos_every)
        out.append(tok)
        pos += 1
        if len(out) >= p.min_tokens and ((tok == EOS and not p.ignore_eos)
                                         or tok in p.stop_token_ids):
            return out, FinishReason.STOP
        if len(out) >= p.max_tokens or pos >= max_model_len:
            return out, FinishReason.LENGTH


def serve(cfg: SchedulerConfig, num_blocks: int, reqs, eos_every: int):
    sched = Scheduler(cfg, num_blocks)
    worker = KVWorker(lambda rid, pos: token_at(rid, pos, eos_every),
                      {spec["req"].req_id: spec["req"].cache_salt for spec in reqs})
    worker.block_size = cfg.block_size
    worker.window = cfg.sliding_window
    outputs: dict[str, list] = {}
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    depth = 2 if cfg.async_scheduling else 1
    multi_step = False
    for step in range(3000):
        for spec in reqs:
            req = spec["req"]
            if spec["arrive"] == step:
                sched.add_request(req)
            if spec["abort_at"] == step:
                for out in sched.abort_requests([req.req_id]):
                    outputs.setdefault(out.req_id, []).append(out)
                check_invariants(sched)
        if step > 16 and not sched.has_unfinished_requests():  # all arrived and done
            for so, mro in in_flight:
                for out in sched.update_from_output(so, mro):
                    outputs.setdefault(out.req_id, []).append(out)
            in_flight = []
            break
        so = sched.schedule()
        check_invariants(sched, so)
        multi_step |= so.num_steps > 1
        in_flight.append((so, worker.execute(so)))
        if len(in_flight) >= depth:
            for out in sched.update_from_output(*in_flight.pop(0)):
                outputs.setdefault(out.req_id, []).append(out)
            check_invariants(sched)
            if cfg.enable_prefix_caching:
                check_prefix_cache_holds_written_kv(sched, worker)
    event(f"multi-step decode ran: {multi_step}")
    return sched, outputs, in_flight


@PROPERTY_SETTINGS
@given(data=st.data())
def test_random_workloads_keep_every_invariant_and_every_token(data):
    cfg, num_blocks = data.draw(configs())
    reqs, eos_every = data.draw(workloads(cfg.max_model_len))
    sched, outputs, in_flight = serve(cfg, num_blocks, reqs, eos_every)
    stats = sched.stats()
    event(f"preempted: {stats.num_preemptions_total > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"blocks freed behind a window: {stats.num_window_freed_blocks_total > 0}")
    fcfs = cfg.policy == "fcfs"
    if fcfs:  # every request finishes when the pool can hold one of maximum length
        assert not sched.has_unfinished_requests() and not in_flight
    else:  # priority promises no such thing; end the rest to check for leaks
        sched.abort_requests(list(sched.requests))
        for so, mro in in_flight:
            sched.update_from_output(so, mro)
    check_invariants(sched)
    assert sched.num_free_blocks == sched.num_total_blocks - 1  # no leaks
    assert not sched.running and len(sched.waiting) == 0
    for spec in reqs:
        req = spec["req"]
        outs = outputs.get(req.req_id, [])
        got = [t for o in outs for t in o.new_token_ids]
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        want, reason = expected_tokens(req, eos_every, cfg.max_model_len)
        if outs[-1].finish_reason == FinishReason.ABORT:
            assert got == want[:len(got)]  # a prefix: nothing duplicated, nothing skipped
        else:
            assert (got, outs[-1].finish_reason) == (want, reason)
        assert outs[-1].num_preemptions == req.num_preemptions
