"""Every type that crosses a hop survives the protobuf round trip unchanged."""

from hypothesis import given, settings, strategies as st

from shared.wire.common import (
    model_info_from_proto, model_info_to_proto, sampling_from_proto, sampling_to_proto)
from shared.wire.engine import request_output_from_proto, request_output_to_proto
from shared.wire.worker import (
    runner_output_from_proto, runner_output_to_proto, scheduler_output_from_proto,
    scheduler_output_to_proto)
from shared import types as t

ids = st.lists(st.integers(0, 2**31 - 1), max_size=8)
req_id = st.text(min_size=1, max_size=8)
carriers = st.dictionaries(st.sampled_from(["traceparent", "tracestate"]), st.text(max_size=8))
finite = st.floats(-100, 100, allow_nan=False, width=32)

sampling = st.builds(
    t.SamplingParams,
    max_tokens=st.integers(1, 4096), temperature=st.floats(0, 2, width=64),
    top_p=st.floats(0.01, 1), top_k=st.integers(-1, 100), min_p=st.floats(0, 1),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    presence_penalty=st.floats(-2, 2), min_tokens=st.integers(0, 4),
    stop_token_ids=ids, ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20))

logprobs = st.builds(t.TokenLogprobs, token_id=st.integers(0, 1000), logprob=finite,
                     rank=st.integers(1, 100),
                     top=st.lists(st.tuples(st.integers(0, 1000), finite), max_size=3))


@st.composite
def scheduler_outputs(draw):
    new = draw(st.lists(st.builds(t.NewRequestData, req_id=req_id, prompt_token_ids=ids,
                                  sampling_params=sampling, block_ids=ids,
                                  num_computed_tokens=st.integers(0, 64),
                                  trace_context=carriers), max_size=3))
    cached = t.CachedRequestData()
    for _ in range(draw(st.integers(0, 3))):
        cached.append(draw(req_id), draw(st.booleans()), draw(ids), draw(st.integers(0, 99)))
    return t.SchedulerOutput(
        step_id=draw(st.integers(0, 2**40)), scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=draw(st.dictionaries(req_id, st.integers(1, 512), max_size=4)),
        total_num_scheduled_tokens=draw(st.integers(0, 4096)),
        finished_req_ids=draw(st.sets(req_id, max_size=3)),
        preempted_req_ids=draw(st.sets(req_id, max_size=3)),
        trace_context=draw(carriers))


@st.composite
def runner_outputs(draw):
    n = draw(st.integers(0, 4))
    return t.ModelRunnerOutput(
        step_id=draw(st.integers(0, 2**40)),
        req_ids=[draw(req_id) for _ in range(n)],
        sampled_token_ids=[draw(ids) for _ in range(n)],
        logprobs=[draw(st.none() | st.lists(logprobs, max_size=2)) for _ in range(n)],
        timings=t.StepTimings(prepare_ms=1.5, forward_ms=2.25, sample_ms=0.5,
                              idle_ms=0.125, start_unix_s=1e9, end_unix_s=1e9 + 1))


@settings(max_examples=50, deadline=None)
@given(sampling)
def test_sampling_params_round_trip(sp):
    assert sampling_from_proto(sampling_to_proto(sp)) == sp


def test_unset_sampling_fields_take_the_defaults():
    from shared.proto import common_pb2
    sp = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0))
    assert sp == t.SamplingParams(temperature=0.0)


@settings(max_examples=50, deadline=None)
@given(scheduler_outputs())
def test_scheduler_output_round_trip(out):
    assert scheduler_output_from_proto(scheduler_output_to_proto(out)) == out


@settings(max_examples=50, deadline=None)
@given(runner_outputs())
def test_runner_output_round_trip_keeps_none_apart_from_empty_logprobs(out):
    assert runner_output_from_proto(runner_output_to_proto(out)) == out


@settings(max_examples=50, deadline=None)
@given(st.builds(t.RequestOutput, req_id=req_id, new_token_ids=ids,
                 new_logprobs=st.lists(logprobs, max_size=2),
                 finish_reason=st.none() | st.sampled_from(t.FinishReason),
                 stop_token_id=st.none() | st.integers(0, 1000),
                 num_preemptions=st.integers(0, 9), num_cached_tokens=st.integers(0, 99)))
def test_request_output_round_trip(out):
    assert request_output_from_proto(request_output_to_proto(out)) == out


def test_model_info_round_trip():
    info = t.ModelInfo("m", 100, 2048, [2, 3], 4, 2, 8, "float32", 77, 16)
    assert model_info_from_proto(model_info_to_proto(info)) == info
