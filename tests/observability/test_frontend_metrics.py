"""RequestTracker: the root span of a request and the client-perceived metrics, read
from the request's choice (frontend_svc/request/choice.py)."""

from __future__ import annotations

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from shared.telemetry import get_logger
from shared.types import FinishReason, SamplingParams
from tests.observability.helpers import give, sample, tracked

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_root_span_continues_the_callers_trace_with_genai_attributes(captured):
    out = captured("frontend")
    t = tracked("r1", "smol", SamplingParams(max_tokens=4, temperature=0.0), 6,
                             {"traceparent": TRACEPARENT}, operation="chat")
    give(t, 1, 0.1)
    t.choice.num_preemptions = 1
    t.finish(FinishReason.LENGTH)
    [span] = out.spans("chat smol")
    assert span.kind is SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert span.attributes["gen_ai.request.model"] == "smol"
    assert span.attributes["gen_ai.request.max_tokens"] == 4
    assert span.attributes["gen_ai.usage.input_tokens"] == 6
    assert span.attributes["gen_ai.usage.output_tokens"] == 1
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)


def test_without_a_traceparent_the_frontend_starts_a_new_trace(captured):
    out = captured("frontend")
    t = tracked("r2", "smol", SamplingParams(), 3)
    t.finish(FinishReason.STOP)
    [span] = out.spans()
    assert span.parent is None


def test_carrier_and_logs_carry_the_request_trace(captured):
    out = captured("frontend")
    t = tracked("r3", "smol", SamplingParams(), 3)
    with t.activate():
        get_logger(request_id="r3").info("queued")
    trace_id = format(t.span.get_span_context().trace_id, "032x")
    assert t.carrier()["traceparent"].split("-")[1] == trace_id
    assert t.metadata() == list(t.carrier().items())
    [line] = out.logs()
    assert line["trace_id"] == trace_id and line["request_id"] == "r3"
    t.finish(FinishReason.STOP)


def test_ttft_histogram_counts_every_request_that_produced_a_token(captured):
    captured("frontend")
    before = sample("gapserve:time_to_first_token_seconds_count", model_name="ttft")
    for i in range(5):
        t = tracked(f"r{i}", "ttft", SamplingParams(), 3)
        give(t, 1, 0.05)
        give(t, 2, 0.25)
        t.finish(FinishReason.STOP)
    assert sample("gapserve:time_to_first_token_seconds_count", model_name="ttft") == before + 5
    assert sample("gapserve:time_to_first_token_seconds_sum", model_name="ttft") == \
        pytest.approx(0.25)
    # two tokens 0.2 s after the first: each 0.1 s apart
    assert sample("gapserve:inter_token_latency_seconds_count", model_name="ttft") == 10
    assert sample("gapserve:inter_token_latency_seconds_sum", model_name="ttft") == \
        pytest.approx(1.0)
    assert sample("gapserve:generation_tokens_total", model_name="ttft") == 15
    assert sample("gapserve:prompt_tokens_total", model_name="ttft") == 15
    assert sample("gapserve:request_success_total", model_name="ttft",
                  finished_reason="stop") == 5
    assert sample("gapserve:e2e_request_latency_seconds_count", model_name="ttft") == 5


def test_a_failed_request_counts_as_an_error_not_a_success(captured):
    out = captured("frontend")
    t = tracked("bad", "err", SamplingParams(), 3)
    t.fail("UNAVAILABLE", "scheduler unreachable")
    t.finish(FinishReason.STOP)  # ignored: the request already ended
    assert sample("gapserve:request_errors_total", model_name="err", code="UNAVAILABLE") == 1
    assert sample("gapserve:request_success_total", model_name="err",
                  finished_reason="stop") == 0
    [span] = out.spans()
    assert span.status.status_code is StatusCode.ERROR


def test_the_frontends_failure_warning_carries_request_and_trace_ids(captured):
    from frontend_svc.telemetry.observe import Observer

    out = captured("frontend")
    t = tracked("r9", "obs", SamplingParams(), 3)
    Observer("obs").fail(t, "UNAVAILABLE", "scheduler unreachable")
    [line] = [x for x in out.logs() if x["event"] == "request failed"]
    assert line["request_id"] == "r9" and line["service"] == "frontend"
    assert line["trace_id"] == format(t.span.get_span_context().trace_id, "032x")
