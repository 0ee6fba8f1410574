"""WorkerTelemetry: step timings become metrics and spans under the scheduler's
step span; each request gets a worker span inside its own trace."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from shared.telemetry import context_carrier, get_tracer
from shared.types import (
    CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, StepTimings)
from tests.observability.helpers import sample
from worker_svc.metrics import WorkerTelemetry


def timings(start=100.0, prepare=1.0, forward=8.0, sample_ms=1.0, idle=2.0, passes=1,
            tokens=7) -> StepTimings:
    end = start + (prepare + forward + sample_ms) / 1000
    return StepTimings(prepare, forward, sample_ms, idle, start, end, passes, tokens)


def test_step_timings_become_histograms_per_rank(captured):
    captured("worker")
    tel = WorkerTelemetry("wm", rank=1)
    before = sample("gapserve:model_forward_time_milliseconds_count", model_name="wm", rank="1")
    tel.step(SchedulerOutput(1, total_num_scheduled_tokens=7), timings(forward=8.0, idle=2.0))
    assert sample("gapserve:model_forward_time_milliseconds_count", model_name="wm",
                  rank="1") == before + 1
    assert sample("gapserve:model_forward_time_milliseconds_sum", model_name="wm",
                  rank="1") >= 8.0
    assert sample("gapserve:worker_idle_time_milliseconds_sum", model_name="wm",
                  rank="1") >= 2.0
    assert sample("gapserve:worker_tokens_total", model_name="wm", rank="1") >= 7
    passes = sample("gapserve:worker_forward_passes_total", model_name="wm", rank="1")
    # a multi-step of 8 passes whose requests all stopped after 3: what ran is counted
    tel.step(SchedulerOutput(2, total_num_scheduled_tokens=2, num_steps=8),
             timings(start=101.0, passes=3, tokens=5))
    assert sample("gapserve:worker_forward_passes_total", model_name="wm",
                  rank="1") == passes + 3


def test_worker_step_span_nests_under_the_step_with_forward_and_sample_children(captured):
    out = captured("worker")
    with get_tracer("scheduler").start_as_current_span("scheduler.step") as step_span:
        carrier = context_carrier()
    WorkerTelemetry("wm").step(SchedulerOutput(3, trace_context=carrier), timings())
    [step] = out.spans("worker.step")
    assert step.parent.span_id == step_span.get_span_context().span_id
    assert step.attributes["gapserve.step.id"] == 3
    forward = out.spans("worker.forward")[0]
    sample_span = out.spans("worker.sample")[0]
    assert forward.parent.span_id == step.context.span_id
    assert (forward.end_time - forward.start_time) == pytest.approx(8e6, rel=1e-3)
    assert forward.end_time <= sample_span.start_time + 1000
    assert step.start_time == 100 * 10**9


def test_prefill_and_recompute_spans_join_the_request_trace(captured):
    out = captured("worker")
    with get_tracer("scheduler").start_as_current_span("scheduler.request") as req_span:
        carrier = context_carrier()
    tel = WorkerTelemetry("wm")
    new = NewRequestData("r", [1, 2, 3], SamplingParams(), [1], 0, trace_context=carrier)
    tel.step(SchedulerOutput(1, scheduled_new_reqs=[new], num_scheduled_tokens={"r": 3}),
             timings())
    decode = CachedRequestData()
    decode.append("r", False, [], 3)
    tel.step(SchedulerOutput(2, scheduled_cached_reqs=decode), timings())  # no span: a decode
    resumed = CachedRequestData()
    resumed.append("r", True, [2], 0)
    tel.step(SchedulerOutput(3, scheduled_cached_reqs=resumed, num_scheduled_tokens={"r": 4}),
             timings(start=200.0))
    prefill, recompute = out.spans("worker.prefill"), out.spans("worker.recompute")
    assert len(prefill) == 1 and len(recompute) == 1
    for span in prefill + recompute:
        assert span.context.trace_id == req_span.get_span_context().trace_id
        assert span.parent.span_id == req_span.get_span_context().span_id
    assert prefill[0].attributes["gapserve.request.num_scheduled_tokens"] == 3
    assert recompute[0].attributes["gapserve.request.num_scheduled_tokens"] == 4
    step3 = next(s for s in out.spans("worker.step") if s.attributes["gapserve.step.id"] == 3)
    assert recompute[0].links[0].context.span_id == step3.context.span_id


def test_a_finished_request_is_forgotten(captured):
    out = captured("worker")
    tel = WorkerTelemetry("wm")
    tel.step(SchedulerOutput(1, scheduled_new_reqs=[
        NewRequestData("r", [1], SamplingParams(), [1], 0)]), timings())
    tel.step(SchedulerOutput(2, finished_req_ids={"r"}), timings())
    resumed = CachedRequestData()
    resumed.append("r", True, [2], 0)
    tel.step(SchedulerOutput(3, scheduled_cached_reqs=resumed), timings())
    assert out.spans("worker.recompute") == []


def test_tracing_off_records_metrics_and_no_spans():
    from shared.telemetry import shutdown_tracing

    shutdown_tracing()
    tel = WorkerTelemetry("off")
    tel.step(SchedulerOutput(1), timings())
    assert sample("gapserve:worker_steps_total", model_name="off", rank="0") == 1
    assert not trace.get_current_span().is_recording()


def test_idle_time_is_the_gap_since_the_previous_step_when_the_runner_leaves_it_out(captured):
    captured("worker")
    tel = WorkerTelemetry("idle")
    first = timings(start=100.0, idle=0.0)  # ends at 100.010
    tel.step(SchedulerOutput(1), first)
    second = timings(start=100.025, idle=0.0)
    tel.step(SchedulerOutput(2), second)
    assert second.idle_ms == pytest.approx(15.0)
    assert sample("gapserve:worker_idle_time_milliseconds_sum", model_name="idle",
                  rank="0") == pytest.approx(15.0)
