"""Telemetry for every service: traces (OpenTelemetry), logs (structlog) and the
Prometheus endpoint. Services call setup_telemetry() once at start-up; the
per-service metric objects live in <service>/metrics.py.
"""

from __future__ import annotations

from typing import IO

from opentelemetry.sdk.trace.export import SpanExporter

from shared.telemetry.logs import (
    LOG_FORMATS, LOG_LEVELS, check_log_settings, get_logger, setup_logging)
from shared.telemetry.metrics_server import MetricsServer, metrics_text, start_metrics_server
from shared.telemetry.tracing import (
    context_carrier, extract_context, flush_traces, get_tracer, inject_context,
    otlp_endpoint_from_env, shutdown_tracing, tracing_enabled)
from shared.telemetry.tracing import build_exporters, install_tracing

__all__ = [
    "LOG_FORMATS", "LOG_LEVELS", "MetricsServer", "context_carrier", "extract_context",
    "finish_reason_name", "flush_traces", "get_logger", "get_tracer", "inject_context",
    "metrics_text",
    "otlp_endpoint_from_env", "setup_telemetry", "shutdown_tracing", "start_metrics_server",
    "tracing_enabled",
]


def setup_telemetry(service_name: str, *, otlp_endpoint: str | None = None,
                    log_format: str = "auto", log_level: str = "info",
                    span_exporter: SpanExporter | None = None,
                    log_stream: IO[str] | None = None) -> None:
    """Configure logs and traces for this process.

    Tracing is on when `otlp_endpoint` is given (host:port or http(s)://host:port,
    OTLP over gRPC), when OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set, or when a
    `span_exporter` is injected (tests: InMemorySpanExporter); otherwise spans are
    no-ops. Standard OTEL_* variables (sampler, batch delays, headers) apply.
    """
    if not service_name:
        raise ValueError("service_name must be a non-empty string")
    check_log_settings(log_format, log_level)
    exporters = build_exporters(otlp_endpoint, span_exporter)  # all checks before any change
    setup_logging(service_name, log_format, log_level, log_stream)
    install_tracing(service_name, exporters)


_FINISH_REASON_NAMES = {1: "stop", 2: "length", 3: "abort"}


def finish_reason_name(reason: int) -> str:
    """The OpenAI / vLLM name of a shared.types.FinishReason ("stop", "length", "abort")."""
    try:
        return _FINISH_REASON_NAMES[int(reason)]
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"unknown finish reason {reason!r}") from None
