"""The hot messages' mapping written out by hand for today's fields, as one would
without shared/wire/: the reference benchmarks/wire_convert.py --baseline times the
derived mapping against (shared/proto_convert.py of e24c3d1 held fewer fields, so
it did less work than the mapping it is compared with). Not used by the services;
tests/wire/test_proto_convert.py checks it converts as shared/wire does, so the
comparison is of equal work.

    .venv/bin/python benchmarks/wire_convert.py --baseline benchmarks/wire_hand_reference.py
"""

from __future__ import annotations

from shared import types as t
from shared.proto import common_pb2, engine_pb2, worker_pb2
from shared.structured.spec import StructuredOutputSpec

_SAMPLING_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                      "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "min_tokens", "ignore_eos", "logprobs", "num_output_prefix_tokens")
_SAMPLING_DEFAULTS = t.SamplingParams()


def _spec_to(s):
    return common_pb2.StructuredOutputSpec(kind=s.kind, value=s.value,
                                           disable_any_whitespace=s.disable_any_whitespace)


def _spec_from(m):
    return StructuredOutputSpec(kind=m.kind, value=m.value,
                                disable_any_whitespace=m.disable_any_whitespace)


def _sampling_to(sp: t.SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        min_p=sp.min_p, seed=sp.seed, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
        min_tokens=sp.min_tokens, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs, logit_bias=sp.logit_bias,
        num_output_prefix_tokens=sp.num_output_prefix_tokens,
        structured_output=None if sp.structured_output is None
        else _spec_to(sp.structured_output))


def _sampling_from(m: common_pb2.SamplingParams) -> t.SamplingParams:
    has, d = m.HasField, _SAMPLING_DEFAULTS
    return t.SamplingParams(
        **{n: getattr(m, n) if has(n) else getattr(d, n) for n in _SAMPLING_OPTIONAL},
        stop_token_ids=list(m.stop_token_ids), logit_bias=dict(m.logit_bias),
        structured_output=_spec_from(m.structured_output)
        if has("structured_output") else None)


def _logprobs_to(lp: t.TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=i, logprob=p) for i, p in lp.top])


def _logprobs_from(m: common_pb2.TokenLogprobs) -> t.TokenLogprobs:
    return t.TokenLogprobs(m.token_id, m.logprob, m.rank,
                           [(x.token_id, x.logprob) for x in m.top])


def scheduler_output_to_proto(o: t.SchedulerOutput) -> worker_pb2.SchedulerOutput:
    c = o.scheduled_cached_reqs
    sched = o.num_scheduled_tokens
    return worker_pb2.SchedulerOutput(
        step_id=o.step_id,
        scheduled_new_reqs=[worker_pb2.NewRequestData(
            req_id=r.req_id, prompt_token_ids=r.prompt_token_ids,
            sampling_params=_sampling_to(r.sampling_params), block_ids=r.block_ids,
            num_computed_tokens=r.num_computed_tokens, trace_context=r.trace_context,
            output_token_ids=r.output_token_ids) for r in o.scheduled_new_reqs],
        scheduled_cached_reqs=worker_pb2.CachedRequestData(
            req_ids=c.req_ids, resumed_from_preemption=c.resumed_from_preemption,
            new_block_ids=[worker_pb2.BlockIds(ids=b) for b in c.new_block_ids],
            num_computed_tokens=c.num_computed_tokens,
            resumed_token_checks={k: worker_pb2.TokenCheck(num_tokens=n, checksum=s)
                                  for k, (n, s) in c.resumed_token_checks.items()}),
        scheduled_req_ids=list(sched), num_scheduled_tokens=list(sched.values()),
        total_num_scheduled_tokens=o.total_num_scheduled_tokens,
        finished_req_ids=sorted(o.finished_req_ids),
        preempted_req_ids=sorted(o.preempted_req_ids), trace_context=o.trace_context,
        num_steps=o.num_steps,
        grammar_compiles={k: _spec_to(s) for k, s in o.grammar_compiles.items()},
        num_draft_slots=[o.num_draft_slots.get(r, 0) for r in sched]
        if o.num_draft_slots else [],
        reset_requests=o.reset_requests)


def scheduler_output_from_proto(m: worker_pb2.SchedulerOutput) -> t.SchedulerOutput:
    c = m.scheduled_cached_reqs
    ids = m.scheduled_req_ids
    return t.SchedulerOutput(
        step_id=m.step_id,
        scheduled_new_reqs=[t.NewRequestData(
            r.req_id, list(r.prompt_token_ids), _sampling_from(r.sampling_params),
            list(r.block_ids), r.num_computed_tokens, dict(r.trace_context),
            list(r.output_token_ids)) for r in m.scheduled_new_reqs],
        scheduled_cached_reqs=t.CachedRequestData(
            list(c.req_ids), list(c.resumed_from_preemption),
            [list(b.ids) for b in c.new_block_ids], list(c.num_computed_tokens),
            {k: (x.num_tokens, x.checksum) for k, x in c.resumed_token_checks.items()}),
        num_scheduled_tokens=dict(zip(ids, m.num_scheduled_tokens)),
        total_num_scheduled_tokens=m.total_num_scheduled_tokens,
        finished_req_ids=set(m.finished_req_ids), preempted_req_ids=set(m.preempted_req_ids),
        trace_context=dict(m.trace_context), num_steps=max(m.num_steps, 1),
        grammar_compiles={k: _spec_from(s) for k, s in m.grammar_compiles.items()},
        num_draft_slots={r: d for r, d in zip(ids, m.num_draft_slots) if d},
        reset_requests=m.reset_requests)


def _timings_to(s: t.StepTimings) -> worker_pb2.StepTimings:
    return worker_pb2.StepTimings(
        prepare_ms=s.prepare_ms, forward_ms=s.forward_ms, sample_ms=s.sample_ms,
        idle_ms=s.idle_ms, start_unix_s=s.start_unix_s, end_unix_s=s.end_unix_s,
        num_forward_passes=s.num_forward_passes, num_tokens=s.num_tokens,
        mask_ms=s.mask_ms, draft_ms=s.draft_ms)


def _timings_from(m: worker_pb2.StepTimings) -> t.StepTimings:
    return t.StepTimings(m.prepare_ms, m.forward_ms, m.sample_ms, m.idle_ms, m.start_unix_s,
                         m.end_unix_s, m.num_forward_passes, m.num_tokens, m.mask_ms,
                         m.draft_ms)


def runner_output_to_proto(o: t.ModelRunnerOutput) -> worker_pb2.ModelRunnerOutput:
    n = len(o.req_ids)
    return worker_pb2.ModelRunnerOutput(
        step_id=o.step_id, req_ids=o.req_ids,
        sampled=[worker_pb2.SampledTokens(token_ids=ids, has_logprobs=lps is not None,
                                          logprobs=[_logprobs_to(x) for x in lps or ()],
                                          num_draft_tokens=nd)
                 for ids, lps, nd in zip(o.sampled_token_ids, o.logprobs or [None] * n,
                                         o.num_draft_tokens or [0] * n)],
        timings=_timings_to(o.timings), grammars_ready=o.grammars_ready,
        grammar_errors=o.grammar_errors, error=o.error, step_skipped=o.step_skipped)


def runner_output_from_proto(m: worker_pb2.ModelRunnerOutput) -> t.ModelRunnerOutput:
    ids, lps, drafts = [], [], []  # one pass over the rows
    for s in m.sampled:
        ids.append(list(s.token_ids))
        lps.append([_logprobs_from(x) for x in s.logprobs] if s.has_logprobs else None)
        drafts.append(s.num_draft_tokens)
    return t.ModelRunnerOutput(
        step_id=m.step_id, req_ids=list(m.req_ids), sampled_token_ids=ids, logprobs=lps,
        timings=_timings_from(m.timings), grammars_ready=list(m.grammars_ready),
        grammar_errors=dict(m.grammar_errors),
        num_draft_tokens=drafts if any(drafts) else [], error=m.error,
        step_skipped=m.step_skipped)


def request_output_to_proto(o: t.RequestOutput) -> engine_pb2.RequestOutput:
    return engine_pb2.RequestOutput(
        request_id=o.req_id, new_token_ids=o.new_token_ids,
        new_logprobs=[_logprobs_to(x) for x in o.new_logprobs],
        finish_reason=int(o.finish_reason or 0), stop_token_id=o.stop_token_id,
        num_preemptions=o.num_preemptions, num_cached_tokens=o.num_cached_tokens,
        queue_time_s=o.queue_time_s, prefill_time_s=o.prefill_time_s)


def request_output_from_proto(m: engine_pb2.RequestOutput) -> t.RequestOutput:
    has = m.HasField
    return t.RequestOutput(
        req_id=m.request_id, new_token_ids=list(m.new_token_ids),
        new_logprobs=[_logprobs_from(x) for x in m.new_logprobs],
        finish_reason=t.FinishReason(m.finish_reason) if m.finish_reason else None,
        stop_token_id=m.stop_token_id if has("stop_token_id") else None,
        num_preemptions=m.num_preemptions, num_cached_tokens=m.num_cached_tokens,
        queue_time_s=m.queue_time_s if has("queue_time_s") else None,
        prefill_time_s=m.prefill_time_s if has("prefill_time_s") else None)
