"""Fixtures: a process-wide telemetry setup with an in-memory span exporter and a
captured JSON log stream; every test here leaves telemetry as it found it."""

from __future__ import annotations

import io

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.telemetry import setup_telemetry, shutdown_tracing
from shared.telemetry.logs import reset_logging
from tests.observability.helpers import Captured


@pytest.fixture(autouse=True)
def _reset_telemetry():
    yield
    shutdown_tracing()
    reset_logging()


@pytest.fixture
def captured():
    """Call with a service name; returns what that 'service' exports."""

    def setup(service: str = "test") -> Captured:
        exporter, stream = InMemorySpanExporter(), io.StringIO()
        setup_telemetry(service, span_exporter=exporter, log_format="json", log_stream=stream)
        return Captured(exporter, stream)

    return setup
