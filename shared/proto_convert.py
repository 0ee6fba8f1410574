"""Translation between shared/types.py and the protobuf messages: one function per
type and direction, so every service edge uses the same mapping."""

from __future__ import annotations

from shared import types as t
from shared.proto import common_pb2, engine_pb2, worker_pb2

_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
    "ignore_eos", "logprobs",
)


# ---------------------------------------------------------------------------
# sampling parameters


def sampling_to_proto(sp: t.SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(stop_token_ids=sp.stop_token_ids,
                                    logit_bias=sp.logit_bias)
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(sp, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> t.SamplingParams:
    """Unset fields take the dataclass defaults; nothing is validated here."""
    sp = t.SamplingParams(stop_token_ids=list(msg.stop_token_ids),
                          logit_bias=dict(msg.logit_bias))
    for name in _OPTIONAL_SAMPLING_FIELDS:
        if msg.HasField(name):
            setattr(sp, name, getattr(msg, name))
    return sp


# ---------------------------------------------------------------------------
# model facts


def model_info_to_proto(info: t.ModelInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_name=info.model_name, vocab_size=info.vocab_size,
        max_model_len=info.max_model_len, eos_token_ids=info.eos_token_ids,
        num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim, dtype=info.dtype, num_kv_blocks=info.num_kv_blocks,
        block_size=info.block_size, max_num_batched_tokens=info.max_num_batched_tokens,
        compute_plan=info.compute_plan)


def model_info_from_proto(msg: common_pb2.ModelInfo) -> t.ModelInfo:
    return t.ModelInfo(
        model_name=msg.model_name, vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len, eos_token_ids=list(msg.eos_token_ids),
        num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim, dtype=msg.dtype, num_kv_blocks=msg.num_kv_blocks,
        block_size=msg.block_size, max_num_batched_tokens=msg.max_num_batched_tokens,
        compute_plan=msg.compute_plan)


# ---------------------------------------------------------------------------
# logprobs


def logprobs_to_proto(lp: t.TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=i, logprob=p) for i, p in lp.top])


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> t.TokenLogprobs:
    return t.TokenLogprobs(token_id=msg.token_id, logprob=msg.logprob, rank=msg.rank,
                           top=[(x.token_id, x.logprob) for x in msg.top])


# ---------------------------------------------------------------------------
# scheduler -> worker


def scheduler_output_to_proto(out: t.SchedulerOutput) -> worker_pb2.SchedulerOutput:
    cached = out.scheduled_cached_reqs
    return worker_pb2.SchedulerOutput(
        step_id=out.step_id,
        scheduled_new_reqs=[
            worker_pb2.NewRequestData(
                req_id=r.req_id, prompt_token_ids=r.prompt_token_ids,
                sampling_params=sampling_to_proto(r.sampling_params),
                block_ids=r.block_ids, num_computed_tokens=r.num_computed_tokens,
                trace_context=r.trace_context, output_token_ids=r.output_token_ids)
            for r in out.scheduled_new_reqs],
        scheduled_cached_reqs=worker_pb2.CachedRequestData(
            req_ids=cached.req_ids,
            resumed_from_preemption=cached.resumed_from_preemption,
            new_block_ids=[worker_pb2.BlockIds(ids=b) for b in cached.new_block_ids],
            num_computed_tokens=cached.num_computed_tokens,
            resumed_token_checks={
                r: worker_pb2.TokenCheck(num_tokens=n, checksum=c)
                for r, (n, c) in cached.resumed_token_checks.items()}),
        scheduled_req_ids=list(out.num_scheduled_tokens.keys()),
        num_scheduled_tokens=list(out.num_scheduled_tokens.values()),
        total_num_scheduled_tokens=out.total_num_scheduled_tokens,
        finished_req_ids=sorted(out.finished_req_ids),
        preempted_req_ids=sorted(out.preempted_req_ids),
        trace_context=out.trace_context, num_steps=out.num_steps)


def scheduler_output_from_proto(msg: worker_pb2.SchedulerOutput) -> t.SchedulerOutput:
    cached = msg.scheduled_cached_reqs
    return t.SchedulerOutput(
        step_id=msg.step_id,
        scheduled_new_reqs=[
            t.NewRequestData(
                req_id=r.req_id, prompt_token_ids=list(r.prompt_token_ids),
                sampling_params=sampling_from_proto(r.sampling_params),
                block_ids=list(r.block_ids), num_computed_tokens=r.num_computed_tokens,
                trace_context=dict(r.trace_context),
                output_token_ids=list(r.output_token_ids))
            for r in msg.scheduled_new_reqs],
        scheduled_cached_reqs=t.CachedRequestData(
            req_ids=list(cached.req_ids),
            resumed_from_preemption=list(cached.resumed_from_preemption),
            new_block_ids=[list(b.ids) for b in cached.new_block_ids],
            num_computed_tokens=list(cached.num_computed_tokens),
            resumed_token_checks={r: (c.num_tokens, c.checksum)
                                  for r, c in cached.resumed_token_checks.items()}),
        num_scheduled_tokens=dict(zip(msg.scheduled_req_ids, msg.num_scheduled_tokens)),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids),
        preempted_req_ids=set(msg.preempted_req_ids),
        trace_context=dict(msg.trace_context), num_steps=max(msg.num_steps, 1))


# ---------------------------------------------------------------------------
# worker -> scheduler


def timings_to_proto(tm: t.StepTimings) -> worker_pb2.StepTimings:
    return worker_pb2.StepTimings(
        prepare_ms=tm.prepare_ms, forward_ms=tm.forward_ms, sample_ms=tm.sample_ms,
        idle_ms=tm.idle_ms, start_unix_s=tm.start_unix_s, end_unix_s=tm.end_unix_s,
        num_forward_passes=tm.num_forward_passes, num_tokens=tm.num_tokens)


def timings_from_proto(msg: worker_pb2.StepTimings) -> t.StepTimings:
    return t.StepTimings(
        prepare_ms=msg.prepare_ms, forward_ms=msg.forward_ms, sample_ms=msg.sample_ms,
        idle_ms=msg.idle_ms, start_unix_s=msg.start_unix_s, end_unix_s=msg.end_unix_s,
        num_forward_passes=msg.num_forward_passes, num_tokens=msg.num_tokens)


def runner_output_to_proto(out: t.ModelRunnerOutput) -> worker_pb2.ModelRunnerOutput:
    logprobs = out.logprobs or [None] * len(out.req_ids)
    return worker_pb2.ModelRunnerOutput(
        step_id=out.step_id, req_ids=out.req_ids,
        sampled=[worker_pb2.SampledTokens(
                    token_ids=ids, has_logprobs=lps is not None,
                    logprobs=[logprobs_to_proto(x) for x in lps or ()])
                 for ids, lps in zip(out.sampled_token_ids, logprobs)],
        timings=timings_to_proto(out.timings))


def runner_output_from_proto(msg: worker_pb2.ModelRunnerOutput) -> t.ModelRunnerOutput:
    return t.ModelRunnerOutput(
        step_id=msg.step_id, req_ids=list(msg.req_ids),
        sampled_token_ids=[list(s.token_ids) for s in msg.sampled],
        logprobs=[[logprobs_from_proto(x) for x in s.logprobs] if s.has_logprobs else None
                  for s in msg.sampled],
        timings=timings_from_proto(msg.timings))


# ---------------------------------------------------------------------------
# scheduler -> frontend


def request_output_to_proto(out: t.RequestOutput) -> engine_pb2.RequestOutput:
    msg = engine_pb2.RequestOutput(
        request_id=out.req_id, new_token_ids=out.new_token_ids,
        new_logprobs=[logprobs_to_proto(x) for x in out.new_logprobs],
        finish_reason=int(out.finish_reason or 0),
        num_preemptions=out.num_preemptions, num_cached_tokens=out.num_cached_tokens)
    if out.stop_token_id is not None:
        msg.stop_token_id = out.stop_token_id
    return msg


def request_output_from_proto(msg: engine_pb2.RequestOutput) -> t.RequestOutput:
    return t.RequestOutput(
        req_id=msg.request_id, new_token_ids=list(msg.new_token_ids),
        new_logprobs=[logprobs_from_proto(x) for x in msg.new_logprobs],
        finish_reason=t.FinishReason(msg.finish_reason) if msg.finish_reason else None,
        stop_token_id=msg.stop_token_id if msg.HasField("stop_token_id") else None,
        num_preemptions=msg.num_preemptions, num_cached_tokens=msg.num_cached_tokens)
