"""Test helpers: captured spans and JSON log lines, Prometheus sample reads."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY


@dataclass(slots=True)
class Captured:
    exporter: InMemorySpanExporter
    log_stream: io.StringIO

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def logs(self) -> list[dict]:
        return [json.loads(line) for line in self.log_stream.getvalue().splitlines()]


def sample(name: str, **labels: str) -> float:
    """Current value of one Prometheus sample (0 when it does not exist yet)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0
