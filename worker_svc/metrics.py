"""Telemetry of a worker, kept at its edges: Prometheus metrics of each step's
timings, a span per step (child of the scheduler's step span, with prepare,
forward and sample children laid out from the worker's own clock), and a span
per request on this worker inside the request's trace.

The worker server makes one call per step, after the runner answered:

    tel = WorkerTelemetry(model_name, rank)
    tel.step(scheduler_output, model_runner_output.timings)

Metric names mirror vLLM's `vllm:*` ones (docs/observability.md has the table).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Histogram

from shared.telemetry import extract_context, get_tracer
from shared.types import SchedulerOutput, StepTimings

_L = ["model_name", "rank"]
MS_BUCKETS = [0.5, 1, 2.5, 5, 10, 25, 50, 75, 100, 250, 500, 1000, 2500, 5000, 10000]

FORWARD_TIME = Histogram("gapserve:model_forward_time_milliseconds",
                         "Model forward pass time per step.", _L, buckets=MS_BUCKETS)
EXECUTE_TIME = Histogram("gapserve:model_execute_time_milliseconds",
                         "Whole step on the worker: input preparation, forward, sampling.",
                         _L, buckets=MS_BUCKETS)
SAMPLE_TIME = Histogram("gapserve:worker_sample_time_milliseconds",
                        "Sampling time per step.", _L, buckets=MS_BUCKETS)
PREPARE_TIME = Histogram("gapserve:worker_prepare_time_milliseconds",
                         "Host-side input preparation time per step.", _L, buckets=MS_BUCKETS)
IDLE_TIME = Histogram("gapserve:worker_idle_time_milliseconds",
                      "Time the worker waited for a step since finishing the previous one.",
                      _L, buckets=MS_BUCKETS)
STEPS = Counter("gapserve:worker_steps", "Steps executed.", _L)
STEP_TOKENS = Counter("gapserve:worker_tokens", "Tokens computed (prompt and output).", _L)

_tracer = get_tracer("gapserve.worker")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass(slots=True)
class WorkerTelemetry:
    model_name: str
    rank: int = 0
    _requests: dict[str, trace.Span] = field(default_factory=dict)
    _series: tuple = ()  # this rank's labelled children, looked up once

    def __post_init__(self) -> None:
        labels = (self.model_name, str(self.rank))
        self._series = tuple(m.labels(*labels) for m in (
            FORWARD_TIME, SAMPLE_TIME, PREPARE_TIME, IDLE_TIME, EXECUTE_TIME, STEPS, STEP_TOKENS))

    def step(self, step: SchedulerOutput, timings: StepTimings) -> None:
        """Record one executed step: metrics, then spans placed at the times the
        runner measured (so tracing adds nothing inside the forward pass)."""
        c = self._series
        c[0].observe(timings.forward_ms)
        c[1].observe(timings.sample_ms)
        c[2].observe(timings.prepare_ms)
        c[3].observe(timings.idle_ms)
        c[4].observe(timings.prepare_ms + timings.forward_ms + timings.sample_ms)
        c[5].inc()
        c[6].inc(step.total_num_scheduled_tokens)

        for req_id in step.finished_req_ids:
            self._end_request(req_id)
        for req_id in step.preempted_req_ids:
            span = self._requests.get(req_id)
            if span is not None:
                span.add_event("preempted: blocks dropped", {"gapserve.step.id": step.step_id})
        for new in step.scheduled_new_reqs:
            if new.req_id not in self._requests:
                self._requests[new.req_id] = _tracer.start_span(
                    "worker.request", context=extract_context(new.trace_context),
                    kind=SpanKind.SERVER, attributes={
                        "gen_ai.request.id": new.req_id,
                        "gapserve.worker.rank": self.rank,
                        "gen_ai.usage.input_tokens": len(new.prompt_token_ids),
                        "gapserve.request.num_cached_tokens": new.num_computed_tokens,
                    })
        self._step_spans(step, timings)

    def _step_spans(self, step: SchedulerOutput, t: StepTimings) -> None:
        total_ms = t.prepare_ms + t.forward_ms + t.sample_ms
        start = t.start_unix_s or time.time() - total_ms / 1000
        end = max(t.end_unix_s or start + total_ms / 1000, start)
        span = _tracer.start_span(
            "worker.step", context=extract_context(step.trace_context), kind=SpanKind.SERVER,
            start_time=_ns(start), attributes={
                "gapserve.step.id": step.step_id,
                "gapserve.worker.rank": self.rank,
                "gapserve.step.num_scheduled_tokens": step.total_num_scheduled_tokens,
                "gapserve.step.num_reqs": len(step.num_scheduled_tokens),
                "gapserve.worker.prepare_ms": t.prepare_ms,
                "gapserve.worker.forward_ms": t.forward_ms,
                "gapserve.worker.sample_ms": t.sample_ms,
                "gapserve.worker.idle_ms": t.idle_ms,
            })
        if span.is_recording():
            ctx = trace.set_span_in_context(span)
            at = start
            for name, ms in (("worker.prepare", t.prepare_ms), ("worker.forward", t.forward_ms),
                             ("worker.sample", t.sample_ms)):
                child = _tracer.start_span(name, context=ctx, start_time=_ns(at))
                at += ms / 1000
                child.end(end_time=_ns(at))
        span.end(end_time=_ns(end))

    def _end_request(self, req_id: str) -> None:
        span = self._requests.pop(req_id, None)
        if span is not None:
            span.end()

    def close(self) -> None:
        """End the spans of requests still held (the worker is shutting down)."""
        for req_id in list(self._requests):
            self._end_request(req_id)
