"""Spans leave the process over OTLP/gRPC and arrive at a real receiver."""

from __future__ import annotations

import io

import pytest

from scheduler_svc.metrics import SchedulerTelemetry
from shared.telemetry import flush_traces, get_tracer, setup_telemetry, shutdown_tracing
from shared.types import FinishReason, RequestOutput, SamplingParams, SchedulerOutput
from tests.observability.otlp_receiver import OtlpReceiver


@pytest.fixture
def receiver():
    r = OtlpReceiver().start()
    yield r
    shutdown_tracing()
    r.stop()


@pytest.mark.parametrize("scheme", ["", "http://"])
def test_spans_arrive_over_the_wire_with_the_service_name(receiver, scheme):
    setup_telemetry("scheduler", otlp_endpoint=scheme + receiver.endpoint,
                    log_stream=io.StringIO())
    with get_tracer("t").start_as_current_span("over the wire") as span:
        span.set_attribute("gen_ai.request.max_tokens", 7)
    assert flush_traces()
    [got] = receiver.wait_for(lambda spans: len(spans) >= 1)
    assert (got.service, got.name) == ("scheduler", "over the wire")
    assert got.attributes["gen_ai.request.max_tokens"] == 7


def test_the_standard_otel_variable_alone_sends_spans(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://{receiver.endpoint}")
    setup_telemetry("worker", log_stream=io.StringIO())
    get_tracer("t").start_span("from env").end()
    assert flush_traces()
    [got] = receiver.wait_for(lambda spans: len(spans) >= 1)
    assert (got.service, got.name) == ("worker", "from env")


def test_step_links_and_lifecycle_events_survive_the_wire(receiver):
    setup_telemetry("scheduler", otlp_endpoint=receiver.endpoint, log_stream=io.StringIO())
    tel = SchedulerTelemetry("m", max_num_seqs=2)
    tel.request_added("a", 3, SamplingParams())
    step = SchedulerOutput(1, num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3)
    tel.step_scheduled(step, {"num_running": 1})
    tel.step_finished(1)
    tel.request_outputs([RequestOutput("a", [5], finish_reason=FinishReason.STOP)])
    assert flush_traces()
    spans = receiver.wait_for(lambda s: len(s) >= 2)
    req = next(s for s in spans if s.name == "scheduler.request")
    step_span = next(s for s in spans if s.name == "scheduler.step")
    assert step_span.links == [(req.trace_id, req.span_id)]
    assert [name for name, _ in req.events][-1] == "finished"
    assert req.attributes["gen_ai.response.finish_reasons"] == ("stop",)
