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


def tracked(req_id: str, model: str, params, num_prompt_tokens: int, incoming=None,
            **kwargs):
    """A RequestTracker over a bare choice of num_prompt_tokens tokens: it reads
    counts and timings from the choice (frontend_svc/request/choice.py)."""
    from frontend_svc.request.choice import Choice
    from frontend_svc.telemetry.metrics import RequestTracker
    choice = Choice.for_prompt(req_id, [1] * num_prompt_tokens, params)
    return RequestTracker.start(choice, model, incoming, **kwargs)


def give(tracker, num_tokens: int, after_s: float) -> None:
    """The client was given num_tokens more, after_s seconds after the arrival."""
    tracker.choice.record_tokens(num_tokens, tracker.choice.arrival_s + after_s)
    tracker.on_tokens(num_tokens)
