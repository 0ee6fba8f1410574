"""Telemetry of the scheduler, kept at its edges: Prometheus metrics, the span of
every scheduling step (linked to the request spans it served), each request's
lifecycle span (queued, scheduled, preempted, first token, finished), the
preemption warning, and the live capacity diagnosis.

The engine makes a handful of calls, all with objects it already has:

    tel = SchedulerTelemetry(model_name, max_num_seqs, max_num_batched_tokens)
    tel.request_added(req_id, num_prompt_tokens, sampling_params, trace_context)
    tel.request_carrier(req_id)                 # trace context for its NewRequestData
    carrier = tel.step_scheduled(scheduler_output, scheduler.stats(), started_s)
    tel.step_finished(step_id, model_runner_output)
    tel.request_outputs(request_outputs)        # first tokens and finishes
    tel.refresh(scheduler.stats())              # after applying a result or aborts
    tel.status(scheduler.stats())               # GetStatus: the diagnosis dict

Metric names mirror vLLM's `vllm:*` ones (docs/observability.md has the table).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Gauge, Histogram

from scheduler_svc.diagnosis import CapacityMonitor, CapacityReading, Diagnosis, diagnose
from scheduler_svc.spec_metrics import SpecTelemetry
from shared.telemetry import (
    context_carrier, extract_context, finish_reason_name, get_logger, get_tracer,
    tracing_enabled)
from shared.types import (
    FinishReason, ModelRunnerOutput, RequestOutput, SamplingParams, SchedulerOutput)

_M = ["model_name"]
REQUEST_TIME_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# the scheduler's admission bound (issue 28 item 7): adds refused over all frontends
# and engine-protocol gateways
REJECTED_FULL = Counter("gapserve:scheduler_rejected_requests",
                        "Adds the scheduler refused with RESOURCE_EXHAUSTED: it held "
                        "max-num-seqs + --max-queued-requests open requests.")
NUM_REQUESTS_RUNNING = Gauge("gapserve:num_requests_running",
                             "Number of requests in RUNNING (model execution batches).", _M)
NUM_REQUESTS_WAITING = Gauge("gapserve:num_requests_waiting",
                             "Number of requests in WAITING.", _M)
NUM_REQUESTS_WAITING_BY_REASON = Gauge(
    "gapserve:num_requests_waiting_by_reason",
    "Requests in WAITING, by reason: capacity (no room) or not_ready.", _M + ["reason"])
KV_CACHE_USAGE = Gauge("gapserve:kv_cache_usage_perc",
                       "KV-cache usage: 1 = every block held (0..1).", _M)
NUM_PREEMPTIONS = Counter("gapserve:num_preemptions",
                          "Cumulative number of preemptions (by recomputation).", _M)
REQUEST_PREEMPTIONS = Histogram("gapserve:request_preemptions",
                                "Preemptions a request suffered, observed when it finishes.", _M,
                                buckets=[0, 1, 2, 3, 5, 10, 20, 50, 100])
PREFIX_CACHE_QUERIES = Counter("gapserve:prefix_cache_queries",
                               "Prefix-cache queries, in tokens.", _M)
PREFIX_CACHE_HITS = Counter("gapserve:prefix_cache_hits",
                            "Prefix-cache hits, in tokens.", _M)
WINDOW_FREED_BLOCKS = Counter(
    "gapserve:kv_window_freed_blocks",
    "KV blocks freed behind a sliding window while their request ran (a model whose "
    "every attention layer is windowed; docs/scheduling.md).", _M)
ITERATION_TOKENS = Histogram("gapserve:iteration_tokens_total",
                             "Tokens scheduled per step.", _M,
                             buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                      16384])
FORWARD_PASSES = Counter("gapserve:forward_passes",
                         "Forward passes the workers were asked to run; more than the "
                         "steps when multi-step decode (--num-scheduler-steps) applies.", _M)
STEP_DURATION = Histogram("gapserve:step_duration_seconds",
                          "From scheduling a step to processing its result.", _M,
                          buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                   2.5, 5.0, 10.0])
STRUCTURED_OUTPUT_MASK_TIME = Histogram(
    "gapserve:structured_output_mask_seconds",
    "Per step with structured-output requests: rank 0's time filling and applying "
    "their grammar masks (StepTimings.mask_ms).", _M,
    buckets=[0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1])
REQUEST_QUEUE_TIME = Histogram("gapserve:request_queue_time_seconds",
                               "Time in WAITING before first scheduled.", _M,
                               buckets=REQUEST_TIME_BUCKETS)
REQUEST_PREFILL_TIME = Histogram("gapserve:request_prefill_time_seconds",
                                 "From first scheduled to first token.", _M,
                                 buckets=REQUEST_TIME_BUCKETS)
REQUEST_DECODE_TIME = Histogram("gapserve:request_decode_time_seconds",
                                "From first token to the last.", _M,
                                buckets=REQUEST_TIME_BUCKETS)
REQUEST_INFERENCE_TIME = Histogram("gapserve:request_inference_time_seconds",
                                   "From first scheduled to finished.", _M,
                                   buckets=REQUEST_TIME_BUCKETS)
WORKER_RECONNECTS = Counter("gapserve:worker_reconnects",
                            "Times the scheduler reconnected to its workers after losing "
                            "them (docs/resilience.md).", _M)
REQUESTS_RECOVERED = Counter("gapserve:requests_recovered",
                             "Running requests requeued by recompute when a worker was lost.",
                             _M)
WORKER_DISAGREEMENTS = Counter("gapserve:worker_disagreements",
                               "Step answers that contradicted the scheduler (stop decision, "
                               "tokens); each is recovered as a worker loss.", _M)
REQUESTS_FAILED = Counter("gapserve:requests_failed",
                          "Requests failed by the scheduler because they broke the workers: "
                          "cause=step_failed (failed alone after a retry, or in too many "
                          "failed steps) or worker_lost (in flight at two worker losses in "
                          "a row); docs/resilience.md.", _M + ["cause"])
STEPS_FAILED = Counter("gapserve:steps_failed",
                       "Steps the workers answered with an error; each is retried by "
                       "recompute (docs/resilience.md).", _M)
WORKER_RECONNECT_FAILURES = Counter("gapserve:worker_reconnect_failures",
                                    "Reconnect rounds to lost workers that failed (each is "
                                    "backed off; the log says so once per burst).", _M)
WORKER_FAILOVERS = Counter("gapserve:worker_failovers",
                           "Reconnects after a worker loss that made another worker group "
                           "(a spare in --worker-addresses) the active one.", _M)
WORKER_GROUP_ACTIVE = Gauge("gapserve:worker_group_active",
                            "1 for the worker group the scheduler drives (addresses in rank "
                            "order), 0 for one it drove before.", _M + ["addresses"])
SESSION_COALESCED_STEPS = Counter(
    "gapserve:session_coalesced_steps",
    "Steps whose outputs waited for a frontend to read them and went out in one "
    "message with an earlier step's: that frontend reads more slowly than steps end "
    "(consider --api-server-count).", _M)
KV_EVENTS_PUBLISHED = Counter("gapserve:kv_events_published",
                              "KV cache events (--kv-events-config) sent on the ZMQ PUB "
                              "socket.", _M)
KV_EVENTS_DROPPED = Counter("gapserve:kv_events_dropped",
                            "KV cache events dropped because the publisher's queue "
                            "(max_queue_size) was full: subscribers see a sequence gap.", _M)
WORKERS_CONNECTED = Gauge("gapserve:workers_connected",
                          "1 while the scheduler holds a Step stream to its workers.", _M)
CAPACITY_DIAGNOSIS = Gauge("gapserve:capacity_diagnosis",
                           "1 for the current capacity diagnosis, 0 for the others.",
                           _M + ["diagnosis"])

PREEMPTION_ADVICE = (
    "preempted by recomputation because the KV cache had no free space; its KV will be "
    "recomputed when it resumes. To relieve it: give the KV cache more memory "
    "(--gpu-memory-utilization, --kv-cache-memory, --num-gpu-blocks-override), run fewer "
    "concurrent sequences (--max-num-seqs) or use a smaller token budget "
    "(--max-num-batched-tokens)")

# vLLM's rate: the first preemption and every 50th are logged, with the cumulative
# count; every one is counted (gapserve:num_preemptions) and is an event on its span.
PREEMPTION_LOG_EVERY = 50

_tracer = get_tracer("gapserve.scheduler")


def _stat(stats: Any, name: str, default: Any = 0) -> Any:
    # scheduler_svc.core.stats.SchedulerStats, or a dict with its field names (tests)
    if type(stats) is dict:
        return stats.get(name, default)
    return getattr(stats, name, default)


def reading_from_stats(stats: Any) -> CapacityReading:
    """The one place that reads Scheduler.stats() for the diagnosis and gauges."""
    not_ready = int(_stat(stats, "num_waiting_not_ready"))
    return CapacityReading(
        running=int(_stat(stats, "num_running")),
        waiting=int(_stat(stats, "num_waiting")) - not_ready,  # num_waiting includes them
        waiting_not_ready=not_ready,
        preemptions_total=int(_stat(stats, "num_preemptions_total")),
        kv_cache_usage=float(_stat(stats, "kv_usage", 0.0)),
        admission_blocked_by=_stat(stats, "admission_blocked_by", None),
    )


@dataclass(slots=True)
class _Request:
    span: trace.Span
    arrival_s: float
    num_prompt_tokens: int
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class _Step:
    span: trace.Span | None  # None: tracing is off
    started_s: float


@dataclass(slots=True)
class _Series:
    """One model's labelled children, looked up once instead of on every step."""

    running: Any
    waiting: Any
    waiting_capacity: Any
    waiting_not_ready: Any
    kv_usage: Any
    prefix_queries: Any
    prefix_hits: Any
    iteration_tokens: Any
    forward_passes: Any
    step_duration: Any
    preemptions: Any  # made at start, so dashboards see 0 rather than no series
    window_freed: Any

    @classmethod
    def of(cls, m: str) -> _Series:
        return cls(NUM_REQUESTS_RUNNING.labels(m), NUM_REQUESTS_WAITING.labels(m),
                   NUM_REQUESTS_WAITING_BY_REASON.labels(m, "capacity"),
                   NUM_REQUESTS_WAITING_BY_REASON.labels(m, "not_ready"),
                   KV_CACHE_USAGE.labels(m), PREFIX_CACHE_QUERIES.labels(m),
                   PREFIX_CACHE_HITS.labels(m), ITERATION_TOKENS.labels(m),
                   FORWARD_PASSES.labels(m), STEP_DURATION.labels(m),
                   NUM_PREEMPTIONS.labels(m), WINDOW_FREED_BLOCKS.labels(m))


@dataclass(slots=True)
class SchedulerTelemetry:
    model_name: str
    max_num_seqs: int
    max_num_batched_tokens: int = 0
    num_speculative_tokens: int = 0  # k of --speculative-config; 0: no speculation
    diagnosis_window_s: float = 30.0
    clock: Any = time.monotonic
    # the SDK keeps at most this many links per span anyway
    max_step_links: int = field(
        default_factory=lambda: int(os.environ.get("OTEL_SPAN_LINK_COUNT_LIMIT", "128")))
    _requests: dict[str, _Request] = field(default_factory=dict)
    _steps: dict[int, _Step] = field(default_factory=dict)
    _monitor: CapacityMonitor | None = None
    _diagnosis: Diagnosis | None = None
    _prefix_seen: tuple[int, int] = (0, 0)  # cumulative (queries, hits) already counted
    _window_freed_seen: int = 0  # cumulative blocks freed behind a window, counted
    _preemptions_total: int = 0
    _log: Any = None
    _series: _Series | None = None
    _worker_group: str | None = None  # the active group's label of worker_group_active
    _spec: SpecTelemetry | None = None

    def __post_init__(self) -> None:
        self._monitor = CapacityMonitor(self.max_num_seqs, self.diagnosis_window_s)
        self._log = get_logger()
        self._series = _Series.of(self.model_name)
        if self.num_speculative_tokens:
            self._spec = SpecTelemetry(self.model_name, self.num_speculative_tokens)
        # made at start, so dashboards see 0 rather than no series
        WORKER_RECONNECTS.labels(self.model_name)
        WORKER_FAILOVERS.labels(self.model_name)
        WORKER_DISAGREEMENTS.labels(self.model_name)
        REQUESTS_RECOVERED.labels(self.model_name)
        WORKERS_CONNECTED.labels(self.model_name).set(1)

    # -- requests ------------------------------------------------------------

    def request_added(self, req_id: str, num_prompt_tokens: int, params: SamplingParams,
                      trace_context: Any = None) -> None:
        """A request entered WAITING; `trace_context` is the frontend's carrier
        (gRPC metadata pairs or a dict with `traceparent`)."""
        span = _tracer.start_span(
            "scheduler.request", context=extract_context(trace_context), kind=SpanKind.SERVER,
            attributes={
                "gen_ai.request.id": req_id,
                "gen_ai.request.model": self.model_name,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.usage.input_tokens": num_prompt_tokens,
            })
        if params.num_output_prefix_tokens:  # a continuation: its prompt's tail is output
            span.set_attribute("gapserve.request.num_output_prefix_tokens",
                               params.num_output_prefix_tokens)
        span.add_event("queued")
        self._requests[req_id] = _Request(span, self.clock(), num_prompt_tokens)

    def request_carrier(self, req_id: str) -> dict[str, str]:
        """Trace context of the request's span, to send once with its NewRequestData
        so the workers' spans for it join the request's trace."""
        req = self._requests.get(req_id)
        if req is None:
            return {}
        return context_carrier(trace.set_span_in_context(req.span))

    def request_outputs(self, outputs: Iterable[RequestOutput]) -> None:
        """Marks first tokens and finishes from the outputs sent to frontends."""
        now = self.clock()
        for out in outputs:
            req = self._requests.get(out.req_id)
            if req is None:
                continue
            if out.new_token_ids and req.first_token_s is None:
                req.first_token_s = now
                req.span.add_event("first_token")
                if req.first_scheduled_s is not None:
                    REQUEST_PREFILL_TIME.labels(self.model_name).observe(
                        now - req.first_scheduled_s)
                    # the frontend exports them as vLLM's (frontend_svc/telemetry/vllm_metrics.py)
                    out.queue_time_s = req.first_scheduled_s - req.arrival_s
                    out.prefill_time_s = now - req.first_scheduled_s
            req.num_output_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                self._finish(out.req_id, req, out.finish_reason, now)

    def request_finished(self, req_id: str, reason: FinishReason) -> None:
        """For an end that no RequestOutput reports (e.g. an abort from the frontend)."""
        req = self._requests.get(req_id)
        if req is not None:
            self._finish(req_id, req, reason, self.clock())

    def _finish(self, req_id: str, req: _Request, reason: FinishReason, now: float) -> None:
        del self._requests[req_id]
        name = finish_reason_name(reason)
        m = self.model_name
        REQUEST_PREEMPTIONS.labels(m).observe(req.num_preemptions)
        if req.first_scheduled_s is None:
            REQUEST_QUEUE_TIME.labels(m).observe(now - req.arrival_s)
        else:
            REQUEST_INFERENCE_TIME.labels(m).observe(now - req.first_scheduled_s)
        if req.first_token_s is not None:
            REQUEST_DECODE_TIME.labels(m).observe(now - req.first_token_s)
        req.span.add_event("finished", {"reason": name})
        req.span.set_attributes({
            "gen_ai.usage.output_tokens": req.num_output_tokens,
            "gen_ai.response.finish_reasons": [name],
            "gapserve.request.num_preemptions": req.num_preemptions,
        })
        req.span.end()

    # -- steps ---------------------------------------------------------------

    def step_scheduled(self, output: SchedulerOutput, stats: Any,
                       started_s: float | None = None) -> dict[str, str]:
        """One step was scheduled: count it, open its span (linked to the requests
        it serves), emit preemption events. Returns the trace carrier to send
        with the step to the workers, so their spans nest under this one."""
        now = self.clock()
        started = now if started_s is None else started_s
        cached = output.scheduled_cached_reqs
        num_resumed = sum(cached.resumed_from_preemption)
        for new in output.scheduled_new_reqs:
            self._scheduled(new.req_id, now, resumed=False)
        if num_resumed:
            for req_id, resumed in zip(cached.req_ids, cached.resumed_from_preemption, strict=True):
                if resumed:
                    self._scheduled(req_id, now, resumed=True)
        for req_id in output.preempted_req_ids:
            self._preempted(req_id)
        reading = reading_from_stats(stats)
        self._record_gauges(reading, stats, now)
        self._series.iteration_tokens.observe(output.total_num_scheduled_tokens)
        self._series.forward_passes.inc(output.num_steps)
        if not tracing_enabled():  # per-request work below only when someone looks
            self._steps[output.step_id] = _Step(None, started)
            return {}

        attributes = {
            "gapserve.step.id": output.step_id,
            "gapserve.step.num_scheduled_tokens": output.total_num_scheduled_tokens,
            "gapserve.step.num_forward_passes": output.num_steps,
            "gapserve.step.num_new_reqs": len(output.scheduled_new_reqs),
            "gapserve.step.num_resumed_reqs": num_resumed,
            "gapserve.step.num_running_reqs": len(cached) - num_resumed,
            "gapserve.step.num_preempted": len(output.preempted_req_ids),
            "gapserve.step.num_finished": len(output.finished_req_ids),
            "gapserve.scheduler.running": reading.running,
            "gapserve.scheduler.waiting": reading.waiting + reading.waiting_not_ready,
            "gapserve.scheduler.kv_cache_usage": reading.kv_cache_usage,
        }
        if output.num_draft_slots:
            attributes["gapserve.step.num_draft_slots"] = sum(output.num_draft_slots.values())
        if self.max_num_batched_tokens:
            attributes["gapserve.step.budget_used"] = (
                output.total_num_scheduled_tokens / self.max_num_batched_tokens)
        span = _tracer.start_span("scheduler.step", context=Context(), attributes=attributes,
                                  start_time=time.time_ns() - int((now - started) * 1e9))
        if span.is_recording():  # a step the sampler dropped costs no links
            self._link_requests(span, output)
        self._steps[output.step_id] = _Step(span, started)
        return context_carrier(trace.set_span_in_context(span))

    def _link_requests(self, span: trace.Span, output: SchedulerOutput) -> None:
        """A step serves many requests: it links to them instead of being a child.
        Requests whose state changed (new, resumed, preempted) come first; past the
        span's link limit the rest are counted, not linked (each link costs ~10 us)."""
        cached = output.scheduled_cached_reqs
        changed = [new.req_id for new in output.scheduled_new_reqs]
        changed += [rid for rid, resumed in zip(cached.req_ids, cached.resumed_from_preemption,
                                                strict=True) if resumed]
        changed += output.preempted_req_ids
        first = set(changed)
        ordered = changed + [rid for rid in output.num_scheduled_tokens if rid not in first]
        reqs = [r for r in map(self._requests.get, ordered) if r is not None]
        for req in reqs[:self.max_step_links]:
            span.add_link(req.span.get_span_context())
        if len(reqs) > self.max_step_links:
            span.set_attribute("gapserve.step.num_links_dropped", len(reqs) - self.max_step_links)

    def step_finished(self, step_id: int, result: ModelRunnerOutput | None = None) -> None:
        """The workers answered step `step_id` (None: it was dropped)."""
        step = self._steps.pop(step_id, None)
        if step is None:
            return
        self._series.step_duration.observe(self.clock() - step.started_s)
        if result is not None and result.timings.mask_ms:
            STRUCTURED_OUTPUT_MASK_TIME.labels(self.model_name).observe(
                result.timings.mask_ms / 1e3)
        spec = {} if result is None or self._spec is None else self._spec.step_finished(result)
        if step.span is None:
            return
        if result is not None:
            t = result.timings
            step.span.set_attributes({
                "gapserve.worker.prepare_ms": t.prepare_ms,
                "gapserve.worker.forward_ms": t.forward_ms,
                "gapserve.worker.sample_ms": t.sample_ms,
                "gapserve.worker.idle_ms": t.idle_ms,
                "gapserve.worker.mask_ms": t.mask_ms, **spec,
            })
        else:
            step.span.set_status(Status(StatusCode.ERROR, "step dropped"))
        step.span.end()

    def _scheduled(self, req_id: str, now: float, resumed: bool) -> None:
        req = self._requests.get(req_id)
        if req is None:
            return
        if resumed:
            req.span.add_event("resumed", {"gapserve.request.num_preemptions": req.num_preemptions})
        elif req.first_scheduled_s is None:
            req.first_scheduled_s = now
            req.span.add_event("first_scheduled")
            REQUEST_QUEUE_TIME.labels(self.model_name).observe(now - req.arrival_s)

    def _preempted(self, req_id: str) -> None:
        self._series.preemptions.inc()
        self._preemptions_total += 1
        req = self._requests.get(req_id)
        count = 0
        ids = {}
        if req is not None:
            req.num_preemptions += 1
            count = req.num_preemptions
            req.span.add_event("preempted", {"gapserve.request.num_preemptions": count})
            ctx = req.span.get_span_context()
            if ctx.is_valid:  # the line belongs to the request's trace, not the step's
                ids = {"trace_id": format(ctx.trace_id, "032x"),
                       "span_id": format(ctx.span_id, "016x")}
        total = self._preemptions_total
        if total == 1 or total % PREEMPTION_LOG_EVERY == 0:  # the counter and span have each
            self._log.warning(
                f"request {req_id} was {PREEMPTION_ADVICE}", request_id=req_id,
                num_preemptions=count, preemptions_total=total, **ids)

    def _record_gauges(self, reading: CapacityReading, stats: Any, now: float) -> None:
        c = self._series
        c.running.set(reading.running)
        c.waiting.set(reading.waiting + reading.waiting_not_ready)
        c.waiting_capacity.set(reading.waiting)
        c.waiting_not_ready.set(reading.waiting_not_ready)
        c.kv_usage.set(reading.kv_cache_usage)
        queries = int(_stat(stats, "prefix_cache_queries"))
        hits = int(_stat(stats, "prefix_cache_hits"))
        seen_q, seen_h = self._prefix_seen
        # stats carry cumulative totals; a counter only goes up by the difference
        if queries > seen_q:
            c.prefix_queries.inc(queries - seen_q)
        if hits > seen_h:
            c.prefix_hits.inc(hits - seen_h)
        self._prefix_seen = (max(queries, seen_q), max(hits, seen_h))
        freed = int(_stat(stats, "num_window_freed_blocks_total"))
        if freed > self._window_freed_seen:
            c.window_freed.inc(freed - self._window_freed_seen)
            self._window_freed_seen = freed
        if self._spec is not None:
            self._spec.observe(stats)
        self._monitor.observe(reading, now)
        self._set_diagnosis(diagnose(reading.running, self.max_num_seqs, reading.waiting,
                                     self._monitor.preemptions_in_window(now),
                                     reading.admission_blocked_by))

    def _set_diagnosis(self, d: Diagnosis) -> None:
        if d is self._diagnosis:
            return
        for each in Diagnosis:
            CAPACITY_DIAGNOSIS.labels(self.model_name, each.value).set(1 if each is d else 0)
        if self._diagnosis is not None:
            self._log.info("capacity diagnosis changed", diagnosis=d.value,
                           previous=self._diagnosis.value)
        self._diagnosis = d

    # -- status --------------------------------------------------------------

    # -- worker loss (docs/resilience.md) -------------------------------------------

    def worker_lost(self, num_recovered: int) -> None:
        m = self.model_name
        WORKERS_CONNECTED.labels(m).set(0)
        REQUESTS_RECOVERED.labels(m).inc(num_recovered)
        for step_id in list(self._steps):  # their results will never come
            self.step_finished(step_id, None)

    def step_failed(self) -> None:
        STEPS_FAILED.labels(self.model_name).inc()

    def request_failed(self, req_id: str, cause: str, message: str) -> None:
        """A request the scheduler failed (docs/resilience.md): counted apart from
        finished ones, its span ends with the error."""
        REQUESTS_FAILED.labels(self.model_name, cause).inc()
        req = self._requests.pop(req_id, None)
        if req is not None:
            req.span.set_attribute("error.type", cause)
            req.span.set_status(Status(StatusCode.ERROR, message))
            req.span.end()

    def worker_reconnect_failed(self) -> None:
        WORKER_RECONNECT_FAILURES.labels(self.model_name).inc()

    def worker_disagreement(self) -> None:
        WORKER_DISAGREEMENTS.labels(self.model_name).inc()

    def worker_reconnected(self, failover: bool = False) -> None:
        WORKER_RECONNECTS.labels(self.model_name).inc()
        if failover:
            WORKER_FAILOVERS.labels(self.model_name).inc()
        WORKERS_CONNECTED.labels(self.model_name).set(1)

    def worker_group_active(self, addresses: list[str]) -> None:
        """The group the scheduler now drives; the one before reads 0."""
        label = ",".join(addresses)
        if self._worker_group is not None:
            WORKER_GROUP_ACTIVE.labels(self.model_name, self._worker_group).set(0)
        WORKER_GROUP_ACTIVE.labels(self.model_name, label).set(1)
        self._worker_group = label

    def refresh(self, stats: Any) -> None:
        """Set the gauges and the diagnosis from current stats: after a step's result
        is applied (requests finished, blocks freed), so an idle server reads idle."""
        self._record_gauges(reading_from_stats(stats), stats, self.clock())

    def status(self, stats: Any) -> dict[str, Any]:
        """Refresh the gauges and the diagnosis from current stats (also when idle)
        and return the status dict (shape: CapacityMonitor.status)."""
        self.refresh(stats)
        return self._monitor.status(self.clock())
