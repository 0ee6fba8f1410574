"""vLLM's metric names on the frontend's /metrics, beside the gapserve:* ones, so
vLLM's Grafana dashboard and autoscaling rules on `vllm:num_requests_waiting` (KEDA)
work unchanged. Names, types, label names (`model_name`, `engine`) and buckets are
vLLM's (vllm/v1/metrics/loggers.py); docs/observability.md has the table.

Two sources:
  * the frontend's own observations of each request (every request passes a
    frontend): tokens, latencies, finish reasons, and the queue and prefill times
    the scheduler measured and sent with the request's first token (only the
    scheduler sees them; RequestOutput.queue_time_s). Ordinary prometheus_client
    metrics; with --api-server-count N they live in PROMETHEUS_MULTIPROC_DIR and a
    scrape sums them over all frontend processes (gapserve/serve.py sets it up).
  * the scheduler's state: running, waiting, KV usage, preemptions, prefix cache.
    Read with GetStatus when /metrics is scraped, so whichever frontend answers
    reports the one scheduler's values; its counters are the scheduler's cumulative
    totals (monotonic; they reset only when the scheduler restarts, as any counter
    of a restarted process does).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from shared.telemetry import get_logger

log = get_logger(component="vllm_metrics")

LABELS = ["model_name", "engine"]
ENGINE = "0"  # one scheduler behind a frontend: vLLM's engine index 0
STATUS_TIMEOUT_S = 1.0  # a scrape waits at most this long for the scheduler
# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_TIME_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's token-count buckets."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class VllmSeries:
    """One model's vLLM-named children, observed by frontend_svc.metrics.RequestTracker."""

    ttft: Any
    itl: Any
    tpot: Any
    e2e: Any
    decode_time: Any
    queue_time: Any
    prefill_time: Any
    prompt_tokens: Any
    generation_tokens: Any
    request_prompt_tokens: Any
    request_generation_tokens: Any
    request_max_generation_tokens: Any
    max_tokens: Any
    success: Any  # the request_success Counter: labelled per finish reason on use
    model_name: str

    def finished(self, reason: str, e2e_s: float, ttft_s: float | None,
                 decode_s: float, num_prompt_tokens: int, num_output_tokens: int,
                 queue_s: float | None = None, prefill_s: float | None = None) -> None:
        self.e2e.observe(e2e_s)
        self.decode_time.observe(decode_s)
        if queue_s is not None:  # measured by the scheduler: known once it sent a token
            self.queue_time.observe(queue_s)
            self.prefill_time.observe(prefill_s)
        # vLLM's per-request TPOT: the decode time over the tokens after the first
        # (0 with at most one token, as vLLM records it)
        self.tpot.observe(decode_s / (num_output_tokens - 1) if num_output_tokens > 1
                          and ttft_s is not None else 0.0)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        # per choice: vLLM takes the max over a request's n completions
        self.request_max_generation_tokens.observe(num_output_tokens)
        self.success.labels(self.model_name, ENGINE, reason).inc()


@functools.cache
def _families(max_model_len: int) -> tuple:
    """Made once per process: token buckets follow the first model's max_model_len,
    as vLLM's do (a frontend serves one model)."""
    tokens = build_1_2_5_buckets(max_model_len)
    return (
        Histogram("vllm:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", LABELS, buckets=TTFT_BUCKETS),
        Histogram("vllm:inter_token_latency_seconds",
                  "Histogram of inter-token latency in seconds.", LABELS, buckets=ITL_BUCKETS),
        Histogram("vllm:request_time_per_output_token_seconds",
                  "Histogram of time_per_output_token_seconds per request.", LABELS,
                  buckets=ITL_BUCKETS),
        Histogram("vllm:e2e_request_latency_seconds",
                  "Histogram of e2e request latency in seconds.", LABELS,
                  buckets=REQUEST_TIME_BUCKETS),
        Histogram("vllm:request_decode_time_seconds",
                  "Histogram of time spent in DECODE phase for request.", LABELS,
                  buckets=REQUEST_TIME_BUCKETS),
        Histogram("vllm:request_queue_time_seconds",
                  "Histogram of time spent in WAITING phase for request.", LABELS,
                  buckets=REQUEST_TIME_BUCKETS),
        Histogram("vllm:request_prefill_time_seconds",
                  "Histogram of time spent in PREFILL phase for request.", LABELS,
                  buckets=REQUEST_TIME_BUCKETS),
        Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS),
        Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS),
        Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", LABELS,
                  buckets=tokens),
        Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                  LABELS, buckets=tokens),
        Histogram("vllm:request_max_num_generation_tokens",
                  "Histogram of maximum number of requested generation tokens.", LABELS,
                  buckets=tokens),
        Histogram("vllm:request_params_max_tokens",
                  "Histogram of the max_tokens request parameter.", LABELS, buckets=tokens),
        Counter("vllm:request_success", "Count of successfully processed requests.",
                LABELS + ["finished_reason"]),
    )


DEFAULT_MAX_MODEL_LEN = 1 << 20  # before the scheduler told us (not reached in serving)
_token_buckets_max: list[int] = []  # the first max_model_len seen in this process


@functools.cache
def series(model_name: str, max_model_len: int = 0) -> VllmSeries:
    """The model's series; max_model_len (when known) sizes the token buckets."""
    if not _token_buckets_max:
        _token_buckets_max.append(max_model_len or DEFAULT_MAX_MODEL_LEN)
    *histograms, success = _families(_token_buckets_max[0])
    return VllmSeries(*(h.labels(model_name, ENGINE) for h in histograms), success, model_name)


class SchedulerStatusCollector:
    """The scheduler-fed series, from the EngineStatus read for this scrape (none
    when the scheduler did not answer: no stale values)."""

    def __init__(self) -> None:
        self.model_name = ""
        self.status = None

    def collect(self):
        st, labels = self.status, [self.model_name, ENGINE]
        if st is None:
            return
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 st.num_running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 st.num_waiting + st.num_waiting_not_ready),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 st.kv_cache_usage)):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            yield g
        for name, doc, value in (
                ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                 st.num_preemptions_total),
                ("vllm:prefix_cache_queries",
                 "Prefix cache queries, in terms of number of queried tokens.",
                 st.prefix_cache_queries),
                ("vllm:prefix_cache_hits",
                 "Prefix cache hits, in terms of number of cached tokens.",
                 st.prefix_cache_hits)):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value)
            yield c


_status = SchedulerStatusCollector()


@functools.cache
def _registry() -> CollectorRegistry:
    """Under --api-server-count N (PROMETHEUS_MULTIPROC_DIR set): every frontend
    process's series, summed; otherwise this process's default registry."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    registry.register(_status)
    return registry


async def scrape(engine, model_name: str) -> tuple[bytes, str]:
    """The /metrics body: fetch the scheduler's status for its series, then render."""
    from frontend_svc.errors import EngineError  # keeps this module free of grpc at import

    info = engine.model_info
    series(model_name, info.max_model_len if info else 0)  # the series exist from the start
    _status.model_name = model_name
    try:
        _status.status = await engine.get_status(timeout_s=STATUS_TIMEOUT_S)
    except EngineError as exc:
        _status.status = None
        log.warning("scrape without the scheduler's series: no status", code=exc.code.name,
                    error=exc.message)
    return generate_latest(_registry()), CONTENT_TYPE_LATEST
