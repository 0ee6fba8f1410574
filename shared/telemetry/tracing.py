"""Tracing: one OpenTelemetry TracerProvider per process, W3C trace context in and
out of gRPC metadata, HTTP headers and plain dict carriers (message fields).

Tracers handed out by get_tracer() look up the current provider on each call, so
a module may create its tracer at import time, before setup_telemetry() runs, and
tests may install a fresh exporter without restarting the process. With tracing
off the provider is the API's no-op one: a span costs one context attach/detach.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor, SimpleSpanProcessor, SpanExporter)

_NOOP_TRACER = trace.NoOpTracer()


class _NoopSpanContext:
    """`with tracer.start_as_current_span(...)` while tracing is off: yields the
    invalid span and leaves the current context alone."""

    __slots__ = ()

    def __enter__(self) -> trace.Span:
        return trace.INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_NOOP_SPAN_CONTEXT = _NoopSpanContext()


@dataclass(slots=True)
class _TracingState:
    provider: TracerProvider | None = None  # None: tracing is off
    generation: int = 0  # bumps on every setup, so cached tracers refresh


_state = _TracingState()


def otlp_endpoint_from_env() -> str | None:
    """The traces endpoint the standard OTEL_* variables name, if any."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def _otlp_exporter(endpoint: str) -> SpanExporter:
    # Imported here: the gRPC exporter is only loaded when someone exports.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    # A bare host:port means plaintext, as on a laptop or inside compose.
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be host:port or http(s)://host:port, "
                         f"got {endpoint!r}")
    return OTLPSpanExporter(endpoint=endpoint, insecure=parsed.scheme == "http")


def build_exporters(otlp_endpoint: str | None,
                    span_exporter: SpanExporter | None) -> list[tuple[SpanExporter, bool]]:
    """(exporter, batched) pairs for these settings; raises on a bad endpoint."""
    endpoint = otlp_endpoint or otlp_endpoint_from_env()
    exporters: list[tuple[SpanExporter, bool]] = []
    if endpoint:
        exporters.append((_otlp_exporter(endpoint), True))
    if span_exporter is not None:
        exporters.append((span_exporter, False))
    return exporters


def install_tracing(service_name: str, exporters: list[tuple[SpanExporter, bool]]) -> bool:
    """Install the process's provider; returns whether tracing is on."""
    old = _state.provider
    if not exporters:
        _state.provider = None
    else:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        for exporter, batched in exporters:
            # Batched over the wire so a slow collector never blocks a step;
            # synchronous for injected (test) exporters so spans are there on return.
            processor = BatchSpanProcessor(exporter) if batched else SimpleSpanProcessor(exporter)
            provider.add_span_processor(processor)
        _state.provider = provider
    _state.generation += 1
    if old is not None:
        old.shutdown()
    return _state.provider is not None


def tracing_enabled() -> bool:
    """Whether spans are recorded; callers may skip building costly attributes."""
    return _state.provider is not None


def flush_traces(timeout_ms: int = 5000) -> bool:
    """Export every finished span now (call before a process exits)."""
    if _state.provider is None:
        return True
    return _state.provider.force_flush(timeout_ms)


def shutdown_tracing() -> None:
    if _state.provider is not None:
        _state.provider.shutdown()
        _state.provider = None
        _state.generation += 1


class _Tracer(trace.Tracer):
    """Delegates to whichever provider setup_telemetry() installed last."""

    __slots__ = ("_name", "_generation", "_tracer")

    def __init__(self, name: str) -> None:
        self._name = name
        self._generation = -1
        self._tracer: trace.Tracer = _NOOP_TRACER

    def _current(self) -> trace.Tracer:
        if self._generation != _state.generation:
            provider = _state.provider
            self._tracer = _NOOP_TRACER if provider is None else provider.get_tracer(self._name)
            self._generation = _state.generation
        return self._tracer

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        if _state.provider is None:
            return trace.INVALID_SPAN  # tracing off: nothing to build or attach
        return self._current().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        if _state.provider is None:
            return _NOOP_SPAN_CONTEXT
        return self._current().start_as_current_span(*args, **kwargs)


def get_tracer(name: str) -> trace.Tracer:
    return _Tracer(name)


# ---------------------------------------------------------------------------
# context propagation


def inject_context(context: Context | None = None) -> list[tuple[str, str]]:
    """W3C `traceparent` (and `tracestate`, baggage) for the current or given
    context, as gRPC metadata pairs; empty when there is no recording span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return list(carrier.items())


def context_carrier(context: Context | None = None) -> dict[str, str]:
    """The same as inject_context, as a dict for a protobuf map field."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def _as_dict(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if isinstance(metadata, Mapping) or hasattr(metadata, "items"):
        pairs: Iterable[Any] = metadata.items()
    else:
        pairs = metadata
    out: dict[str, str] = {}
    for item in pairs:
        # grpc metadata items are (key, value) tuples or objects with .key/.value.
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if isinstance(value, str):  # binary (-bin) metadata never carries trace context
            out[str(key).lower()] = value
    return out


def extract_context(metadata: Any) -> Context:
    """The caller's trace context from gRPC invocation metadata, HTTP headers or
    a plain dict; an empty context (a new trace) when none arrived."""
    return propagate.extract(_as_dict(metadata))
