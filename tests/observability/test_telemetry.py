"""shared.telemetry: trace setup and propagation, log format and ids."""

from __future__ import annotations

import io
import json
import urllib.request
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from shared.telemetry import (
    context_carrier, extract_context, get_logger, get_tracer, inject_context, setup_telemetry,
    start_metrics_server, tracing_enabled)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_spans_carry_the_service_name(captured):
    out = captured("scheduler")
    with get_tracer("t").start_as_current_span("work"):
        pass
    [span] = out.spans("work")
    assert span.resource.attributes["service.name"] == "scheduler"


def test_a_tracer_made_before_setup_records_after_it(captured):
    tracer = get_tracer("early")  # modules make theirs at import time
    out = captured()
    with tracer.start_as_current_span("late"):
        pass
    assert len(out.spans("late")) == 1


def test_tracing_is_off_without_endpoint_or_exporter(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    setup_telemetry("frontend", log_stream=io.StringIO())
    assert not tracing_enabled()
    with get_tracer("t").start_as_current_span("nothing") as span:
        assert not span.is_recording()
        assert inject_context() == []


def test_standard_otel_endpoint_variable_turns_tracing_on(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1")
    setup_telemetry("worker", log_stream=io.StringIO())
    try:
        assert tracing_enabled()
    finally:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        setup_telemetry("worker", log_stream=io.StringIO())


def test_injected_context_round_trips_through_grpc_metadata(captured):
    captured()
    with get_tracer("t").start_as_current_span("client") as span:
        metadata = inject_context()
    assert [k for k, _ in metadata] == ["traceparent"]
    # grpc hands metadata to servers as objects with .key and .value
    items = [SimpleNamespace(key=k, value=v) for k, v in metadata]
    parent = trace.get_current_span(extract_context(items)).get_span_context()
    assert parent.trace_id == span.get_span_context().trace_id
    assert parent.span_id == span.get_span_context().span_id


def test_http_headers_continue_the_callers_trace(captured):
    out = captured()
    ctx = extract_context({"Traceparent": TRACEPARENT, "Content-Type": "application/json"})
    get_tracer("t").start_span("server", context=ctx, kind=SpanKind.SERVER).end()
    [span] = out.spans("server")
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(span.parent.span_id, "016x") == "b7ad6b7169203331"


def test_missing_or_binary_metadata_starts_a_new_trace(captured):
    captured()
    for metadata in (None, [], [("x-bin", b"\x00"), ("user-agent", "grpc")]):
        assert not trace.get_current_span(extract_context(metadata)).get_span_context().is_valid


def test_context_carrier_is_a_dict_for_message_fields(captured):
    captured()
    with get_tracer("t").start_as_current_span("s"):
        carrier = context_carrier()
    assert set(carrier) == {"traceparent"}


def test_log_lines_are_json_with_service_request_and_trace_ids(captured):
    out = captured("frontend")
    with get_tracer("t").start_as_current_span("req") as span:
        get_logger(request_id="r-1").info("request received", prompt_tokens=5)
    [line] = out.logs()
    assert line["event"] == "request received"
    assert line["service"] == "frontend"
    assert line["request_id"] == "r-1"
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert line["span_id"] == format(span.get_span_context().span_id, "016x")
    assert line["level"] == "info" and "timestamp" in line


def test_standard_library_logs_come_out_as_json_too(captured):
    import logging

    out = captured("scheduler")
    logging.getLogger("grpc._server").warning("stream %s closed", 7)
    [line] = out.logs()
    assert line == {**line, "event": "stream 7 closed", "service": "scheduler",
                    "level": "warning"}


def test_log_level_filters_lower_levels(captured):
    stream = io.StringIO()
    setup_telemetry("worker", log_level="warning", log_format="json", log_stream=stream)
    get_logger().info("quiet")
    get_logger().warning("loud")
    assert [json.loads(x)["event"] for x in stream.getvalue().splitlines()] == ["loud"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_format_is_console_on_a_terminal_and_json_otherwise():
    tty, pipe = _Tty(), io.StringIO()
    setup_telemetry("frontend", log_format="auto", log_stream=tty)
    get_logger().info("hello")
    setup_telemetry("frontend", log_format="auto", log_stream=pipe)
    get_logger().info("hello")
    assert "hello" in tty.getvalue()
    with pytest.raises(json.JSONDecodeError):
        json.loads(tty.getvalue())
    assert json.loads(pipe.getvalue())["event"] == "hello"


@pytest.mark.parametrize("kwargs, message", [
    ({"log_format": "xml"}, "--log-format"),
    ({"log_level": "loud"}, "--log-level"),
    ({"otlp_endpoint": "ftp://collector:4317"}, "--otlp-traces-endpoint"),
])
def test_bad_settings_are_refused_and_change_nothing(captured, kwargs, message):
    out = captured("frontend")
    with pytest.raises(ValueError, match=message):
        setup_telemetry("other", log_stream=io.StringIO(), **kwargs)
    assert tracing_enabled()
    get_logger().info("still here")
    with get_tracer("t").start_as_current_span("still traced"):
        pass
    assert out.logs()[-1]["service"] == "frontend"
    assert len(out.spans("still traced")) == 1


def test_metrics_server_serves_the_default_registry():
    server = start_metrics_server(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read()
    finally:
        server.close()
    assert b"python_info" in body


def test_metrics_server_refuses_a_bad_port():
    with pytest.raises(ValueError, match="--metrics-port"):
        start_metrics_server(70000)


def test_a_logger_made_before_setup_follows_it(captured):
    log = get_logger(component="engine")  # modules make theirs at import time
    out = captured("scheduler")
    log.info("after setup")
    [line] = out.logs()
    assert line["component"] == "engine" and line["service"] == "scheduler"


def test_reset_logging_leaves_the_root_logger_as_it_was():
    import logging

    from shared.telemetry.logs import reset_logging

    handlers = list(logging.getLogger().handlers)
    setup_telemetry("frontend", log_stream=io.StringIO())
    reset_logging()
    assert logging.getLogger().handlers == handlers
