"""Telemetry of a worker, kept at its edges: Prometheus metrics of each step's
timings, a span per step (child of the scheduler's step span, with prepare,
forward and sample children laid out from the worker's own clock), and, inside
each request's own trace, a span for the step that computed its prompt and one
for each step that recomputed it after a preemption.

The worker server makes one call per step, after the runner answered:

    tel = WorkerTelemetry(model_name, rank)
    tel.step(scheduler_output, model_runner_output.timings)

Metric names mirror vLLM's `vllm:*` ones (docs/observability.md has the table).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind
from prometheus_client import Counter, Gauge, Histogram

from shared.telemetry import extract_context, get_tracer, tracing_enabled
from shared.types import SchedulerOutput, StepTimings

_L = ["model_name", "rank"]
MS_BUCKETS = [0.5, 1, 2.5, 5, 10, 25, 50, 75, 100, 250, 500, 1000, 2500, 5000, 10000]

FORWARD_TIME = Histogram("gapserve:model_forward_time_milliseconds",
                         "Model forward pass time per step (all passes of a multi-step "
                         "decode: divide by gapserve:worker_forward_passes_total's rate).",
                         _L, buckets=MS_BUCKETS)
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
WEIGHT_BYTES = Gauge("gapserve:worker_weight_bytes",
                     "Bytes of model weights this rank holds (its tensor-parallel shard).", _L)
STEP_TOKENS = Counter("gapserve:worker_tokens", "Tokens computed (prompt and output).", _L)
FORWARD_PASSES = Counter("gapserve:worker_forward_passes",
                         "Forward passes run; more than the steps when multi-step decode "
                         "(--num-scheduler-steps) runs several in one step, fewer than "
                         "scheduled when every request in it stopped early.", _L)
ARGMAX_SCREEN = Counter(
    "gapserve:worker_argmax_screen_rows",
    "Greedy rows of small CPU steps whose vocabulary projection was screened by its int8 "
    "copy (outcome=screened), or projected in full after the screen left too many "
    "candidates (outcome=full).", [*_L, "outcome"])

MOE_EXPERT_TOKENS = Counter(
    "gapserve:worker_moe_expert_tokens",
    "Tokens routed to each routed expert this rank holds, summed over the model's MoE "
    "layers: an uneven spread is the expert load imbalance.", [*_L, "expert"])

_tracer = get_tracer("gapserve.worker")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass(slots=True)
class WorkerTelemetry:
    model_name: str
    rank: int = 0
    # trace context of each request this worker holds (from its NewRequestData)
    _contexts: dict[str, Context] = field(default_factory=dict)
    _series: tuple = ()  # this rank's labelled children, looked up once
    _last_end_s: float = 0.0  # when the previous step ended (unix seconds)
    _screen_seen: dict = field(default_factory=dict)  # outcome -> rows counted so far
    _experts_seen: list = field(default_factory=list)  # expert -> tokens counted so far

    def __post_init__(self) -> None:
        labels = (self.model_name, str(self.rank))
        self._series = tuple(m.labels(*labels) for m in (
            FORWARD_TIME, SAMPLE_TIME, PREPARE_TIME, IDLE_TIME, EXECUTE_TIME, STEPS, STEP_TOKENS,
            FORWARD_PASSES))

    def argmax_screen(self, rows: dict[str, int]) -> None:
        """The model's running counts of screened rows (DecoderModel.screen_rows)."""
        for outcome, total in rows.items():
            new = total - self._screen_seen.get(outcome, 0)
            if new:
                ARGMAX_SCREEN.labels(self.model_name, str(self.rank), outcome).inc(new)
                self._screen_seen[outcome] = total

    def expert_tokens(self, totals: list[int] | None) -> None:
        """The model's running per-expert token counts (TorchDecoder.expert_tokens);
        None or empty for a model without routed experts."""
        if not totals:
            return
        if len(self._experts_seen) != len(totals):
            self._experts_seen = [0] * len(totals)
        for expert, total in enumerate(totals):
            new = total - self._experts_seen[expert]
            if new:
                MOE_EXPERT_TOKENS.labels(self.model_name, str(self.rank), str(expert)).inc(new)
                self._experts_seen[expert] = total

    def step(self, step: SchedulerOutput, timings: StepTimings) -> None:
        """Record one executed step: metrics, then spans placed at the times the
        runner measured (so tracing adds nothing inside the forward pass). Fills
        in `timings.idle_ms` when the runner left it 0, so the scheduler sees it too."""
        if not timings.idle_ms and timings.start_unix_s and self._last_end_s:
            # steps run strictly in order: the gap since the last one is time spent
            # waiting for the scheduler (or for work at all, when the server is quiet)
            timings.idle_ms = max(0.0, timings.start_unix_s - self._last_end_s) * 1e3
        self._last_end_s = timings.end_unix_s
        c = self._series
        c[0].observe(timings.forward_ms)
        c[1].observe(timings.sample_ms)
        c[2].observe(timings.prepare_ms)
        c[3].observe(timings.idle_ms)
        c[4].observe(timings.prepare_ms + timings.forward_ms + timings.sample_ms)
        c[5].inc()
        c[6].inc(timings.num_tokens)
        c[7].inc(timings.num_forward_passes)

        if not tracing_enabled():
            return
        for req_id in step.finished_req_ids:
            self._contexts.pop(req_id, None)
        for new in step.scheduled_new_reqs:
            self._contexts[new.req_id] = extract_context(new.trace_context)
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
                "gapserve.step.num_forward_passes": t.num_forward_passes,
                "gapserve.worker.prepare_ms": t.prepare_ms,
                "gapserve.worker.forward_ms": t.forward_ms,
                "gapserve.worker.sample_ms": t.sample_ms,
                "gapserve.worker.idle_ms": t.idle_ms,
            })
        ctx = trace.set_span_in_context(span)
        at = start
        for name, ms in (("worker.prepare", t.prepare_ms), ("worker.forward", t.forward_ms),
                         ("worker.sample", t.sample_ms)):
            child = _tracer.start_span(name, context=ctx, start_time=_ns(at))
            at += ms / 1000
            child.end(end_time=_ns(at))
        span.end(end_time=_ns(end))
        self._prefill_spans(step, span, start, end)

    def _prefill_spans(self, step: SchedulerOutput, step_span: trace.Span, start: float,
                       end: float) -> None:
        """In each request's own trace, the steps that computed its prompt: the
        first one, and each one that recomputes it after a preemption (a span per
        admission, never per token)."""
        cached = step.scheduled_cached_reqs
        firsts = [(new.req_id, new.num_computed_tokens, "worker.prefill")
                  for new in step.scheduled_new_reqs]
        firsts += [(rid, n, "worker.recompute") for rid, resumed, n in
                   zip(cached.req_ids, cached.resumed_from_preemption,
                       cached.num_computed_tokens, strict=True) if resumed]
        link = [Link(step_span.get_span_context())]
        for req_id, num_computed, name in firsts:
            ctx = self._contexts.get(req_id)
            if ctx is None:
                continue
            _tracer.start_span(name, context=ctx, kind=SpanKind.SERVER, links=link,
                               start_time=_ns(start), attributes={
                                   "gen_ai.request.id": req_id,
                                   "gapserve.worker.rank": self.rank,
                                   "gapserve.step.id": step.step_id,
                                   "gapserve.request.num_computed_tokens": num_computed,
                                   "gapserve.request.num_scheduled_tokens":
                                       step.num_scheduled_tokens.get(req_id, 0),
                               }).end(end_time=_ns(end))
