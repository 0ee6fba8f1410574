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
  * the scheduler's state: running, waiting (by reason), KV usage, preemptions,
    prefix cache, the cache configuration. Read with GetStatus when /metrics is
    scraped, so whichever frontend answers reports the scheduler's values; its
    counters are the scheduler's cumulative totals (monotonic; they reset only when
    the scheduler restarts, as any counter of a restarted process does).

Under data parallelism each replica is its own `engine` label value, its index, as
vLLM labels its data-parallel engines: the scheduler-fed series come per replica,
and a request's series follow the replica that serves it (ReplicaSet calls routed();
the tracker picks the series up with the request's next output, for_request()).
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


PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's
# vLLM's cache tiers (vllm/v1/metrics/cache_hit_source.py): here only the engine's own
# pool, vLLM's "device", holds cached prompt tokens
CACHE_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
WAITING_REASONS = ("capacity", "deferred")


@dataclass(slots=True)
class VllmSeries:
    """One model's vLLM-named children, observed by telemetry.metrics.RequestTracker."""

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
    prefill_kv_computed: Any
    prompt_tokens_cached: Any
    success: Any  # the request_success Counter: labelled per finish reason on use
    by_source: Any  # the prompt_tokens_by_source Counter: labelled per source on use
    model_name: str
    engine: str = ENGINE

    def finished(self, reason: str, e2e_s: float, ttft_s: float | None,
                 decode_s: float, num_prompt_tokens: int, num_output_tokens: int,
                 queue_s: float | None = None, prefill_s: float | None = None,
                 num_cached_tokens: int = 0) -> None:
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
        self.success.labels(self.model_name, self.engine, reason).inc()
        cached = max(num_cached_tokens, 0)
        self.prefill_kv_computed.observe(max(num_prompt_tokens - cached, 0))
        if ttft_s is not None:  # its prefill ran: vLLM counts a prompt's sources then
            self.prompt_tokens_cached.inc(cached)
            for source, n in zip(PROMPT_SOURCES, (num_prompt_tokens - cached, cached, 0)):
                self.by_source.labels(self.model_name, self.engine, source).inc(n)


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
        Histogram("vllm:request_prefill_kv_computed_tokens",
                  "Histogram of new KV tokens computed during prefill (excluding cached "
                  "tokens).", LABELS, buckets=tokens),
        Counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + "
                "external).", LABELS),
        Counter("vllm:request_success", "Count of successfully processed requests.",
                LABELS + ["finished_reason"]),
        Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                LABELS + ["source"]),
    )


DEFAULT_MAX_MODEL_LEN = 1 << 20  # before the scheduler told us (not reached in serving)
_token_buckets_max: list[int] = []  # the first max_model_len seen in this process


def series(model_name: str, max_model_len: int = 0, engine: str = ENGINE) -> VllmSeries:
    """The model's series at one engine; max_model_len (when known) sizes the token
    buckets."""
    if not _token_buckets_max:
        _token_buckets_max.append(max_model_len or DEFAULT_MAX_MODEL_LEN)
    return _series(model_name, engine)


@functools.cache
def _series(model_name: str, engine: str) -> VllmSeries:
    *children, success, by_source = _families(_token_buckets_max[0])
    out = VllmSeries(*(c.labels(model_name, engine) for c in children), success, by_source,
                     model_name, engine)
    for source in PROMPT_SOURCES:  # present from the start, as vLLM's are
        by_source.labels(model_name, engine, source)
    return out


# data parallelism: request id -> the engine label of the replica serving it
_engine_of: dict[str, str] = {}


def routed(req_id: str, replica: int) -> None:
    """frontend_svc/engine/replicas.py sent the request (or moved it) to that replica."""
    _engine_of[req_id] = str(replica)


def ended(req_id: str) -> None:
    _engine_of.pop(req_id, None)


def for_request(req_id: str, current: VllmSeries) -> VllmSeries:
    """The series of the engine now serving the request (engine "0" without data
    parallelism): the tracker's, or another engine's after routing or a failover."""
    engine = _engine_of.get(req_id, current.engine)
    return current if engine == current.engine else _series(current.model_name, engine)


class SchedulerStatusCollector:
    """The scheduler-fed series, from the EngineStatus read for this scrape, one set
    per engine (none when no scheduler answered: no stale values)."""

    def __init__(self) -> None:
        self.model_name = ""
        self.status = None  # one scheduler's EngineStatus, as engine "0"
        self.engines: list[tuple[str, object]] | None = None  # (engine, status) per replica
        self.block_size = 0  # the engines' KV block size (from the handshake)

    def collect(self):
        engines = self.engines if self.engines is not None else \
            ([] if self.status is None else [(ENGINE, self.status)])
        if not engines:
            return
        m = self.model_name
        gauges = [("vllm:num_requests_running", "Number of requests in model execution "
                   "batches.", lambda st: st.num_running),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                   lambda st: st.num_waiting + st.num_waiting_not_ready),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                   lambda st: st.kv_cache_usage)]
        for name, doc, value in gauges:
            yield _per_engine(GaugeMetricFamily(name, doc, labels=LABELS), m, engines, value)
        g = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. "
            "'capacity' = waiting for scheduling capacity; 'deferred' = not ready to be "
            "scheduled (a grammar still compiling). Sum of all reasons equals "
            "vllm:num_requests_waiting.", labels=LABELS + ["reason"])
        for engine, st in engines:
            g.add_metric([m, engine, "capacity"], st.num_waiting)
            g.add_metric([m, engine, "deferred"], st.num_waiting_not_ready)
        yield g
        counters = [("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                     lambda st: st.num_preemptions_total),
                    ("vllm:prefix_cache_queries",
                     "Prefix cache queries, in terms of number of queried tokens.",
                     lambda st: st.prefix_cache_queries),
                    ("vllm:prefix_cache_hits",
                     "Prefix cache hits, in terms of number of cached tokens.",
                     lambda st: st.prefix_cache_hits)]
        for name, doc, value in counters:
            yield _per_engine(CounterMetricFamily(name, doc, labels=LABELS), m, engines, value)
        c = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache "
            "tier that supplied them: here always the engine's own pool (device). Counted "
            "at admission; sums to vllm:prefix_cache_hits.", labels=LABELS + ["source"])
        for engine, st in engines:
            for source in CACHE_SOURCES:
                c.add_metric([m, engine, source],
                             st.prefix_cache_hits if source == "device" else 0)
        yield c
        yield from self._spec_decode(m, [(e, st) for e, st in engines
                                         if st.speculative_config])
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig (the fields known here)",
                                 labels=["model_name", "engine", "block_size", "num_gpu_blocks"])
        for engine, st in engines:
            info.add_metric([m, engine, str(self.block_size), str(st.num_kv_blocks)], 1)
        yield info


    @staticmethod
    def _spec_decode(m: str, engines):
        """vLLM's spec-decode counters, only where speculation is configured (as vLLM
        exports them only then): the scheduler's cumulative totals (docs/spec_decode.md)."""
        if not engines:
            return
        counters = [("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                     lambda st: st.spec_num_drafts),
                    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                     lambda st: st.spec_num_draft_tokens),
                    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                     lambda st: st.spec_num_accepted_tokens)]
        for name, doc, value in counters:
            yield _per_engine(CounterMetricFamily(name, doc, labels=LABELS), m, engines, value)
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted tokens per draft position.",
                                labels=LABELS + ["position"])
        for engine, st in engines:
            for pos, n in enumerate(st.spec_num_accepted_tokens_per_pos):
                c.add_metric([m, engine, str(pos)], n)
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
    replicas = getattr(engine, "replicas", None)  # a ReplicaSet: data parallelism
    for i in range(len(replicas) if replicas else 1):  # the series exist from the start
        series(model_name, info.max_model_len if info else 0, str(i))
    _status.model_name = model_name
    _status.block_size = info.block_size if info else 0
    try:
        _status.status = await engine.get_status(timeout_s=STATUS_TIMEOUT_S)
    except EngineError as exc:
        _status.status = None
        log.warning("scrape without the scheduler's series: no status", code=exc.code.name,
                    error=exc.message)
    # per replica: the rows get_status just read (a replica that did not answer has none)
    _status.engines = None if not replicas or _status.status is None else [
        (str(r.index), r.status) for r in replicas if r.status is not None]
    return generate_latest(_registry()), CONTENT_TYPE_LATEST


def _per_engine(family, model_name: str, engines, value):
    """One sample per engine (model_name, engine labels) of `family`, value(status)."""
    for engine, st in engines:
        family.add_metric([model_name, engine], value(st))
    return family
