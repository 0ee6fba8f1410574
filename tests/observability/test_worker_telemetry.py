"""WorkerTelemetry: step timings become metrics and spans under the scheduler's
step span; each request gets a worker span inside its own trace."""

from __future__ import annotations

import pytest

from shared.telemetry import context_carrier, get_tracer
from shared.types import NewRequestData, SamplingParams, SchedulerOutput, StepTimings
from tests.observability.helpers import sample
from worker_svc.metrics import WorkerTelemetry
from opentelemetry import trace


def timings(start=100.0, prepare=1.0, forward=8.0, sample_ms=1.0, idle=2.0) -> StepTimings:
    end = start + (prepare + forward + sample_ms) / 1000
    return StepTimings(prepare, forward, sample_ms, idle, start, end)


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


def test_worker_request_span_joins_the_request_trace_and_ends_when_finished(captured):
    out = captured("worker")
    with get_tracer("scheduler").start_as_current_span("scheduler.request") as req_span:
        carrier = context_carrier()
    tel = WorkerTelemetry("wm")
    new = NewRequestData("r", [1, 2, 3], SamplingParams(), [1], 0, trace_context=carrier)
    tel.step(SchedulerOutput(1, scheduled_new_reqs=[new]), timings())
    assert out.spans("worker.request") == []
    tel.step(SchedulerOutput(2, finished_req_ids={"r"}), timings())
    [span] = out.spans("worker.request")
    assert span.context.trace_id == req_span.get_span_context().trace_id
    assert span.parent.span_id == req_span.get_span_context().span_id
    assert span.attributes["gen_ai.usage.input_tokens"] == 3


def test_close_ends_the_spans_of_requests_still_held(captured):
    out = captured("worker")
    tel = WorkerTelemetry("wm")
    new = NewRequestData("r", [1], SamplingParams(), [1], 0)
    tel.step(SchedulerOutput(1, scheduled_new_reqs=[new]), timings())
    tel.close()
    assert len(out.spans("worker.request")) == 1


def test_tracing_off_records_metrics_and_no_spans():
    from shared.telemetry import shutdown_tracing

    shutdown_tracing()
    tel = WorkerTelemetry("off")
    tel.step(SchedulerOutput(1), timings())
    assert sample("gapserve:worker_steps_total", model_name="off", rank="0") == 1
    assert not trace.get_current_span().is_recording()
