"""Telemetry of the frontend, kept at its edges: the root span of each request
(continuing the caller's trace), client-perceived latencies and token counts as
Prometheus metrics, served on the frontend's own HTTP port at /metrics.

A handler makes these calls:

    t = RequestTracker.start(choice, model_name, operation="chat")
    with t.activate():                       # logs inside carry the trace id
        carrier = t.carrier()                # send with the request to the scheduler
        ... for each output from the scheduler: t.on_output(out)
                                                 t.on_tokens(num_given_to_the_client)
        t.finish(choice.finish_reason)
    # or, on an error: t.fail("UNAVAILABLE", "scheduler unreachable")

The tracker keeps no copy of the choice's state: counts and timings are read from
its owner (frontend_svc/request/choice.py) as they change.

/metrics body and content type: frontend_svc.telemetry.vllm_metrics.scrape().
Metric names mirror vLLM's `vllm:*` ones (docs/observability.md has the table), and
every observation also feeds the `vllm:*`-named series themselves (vllm_metrics.py).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Histogram

from shared.telemetry import context_carrier, extract_context, finish_reason_name, get_tracer
from shared.types import FinishReason

from frontend_svc.telemetry import vllm_metrics

if TYPE_CHECKING:  # the owner of a choice's state; typing only (it imports the request path)
    from frontend_svc.request.choice import Choice

_M = ["model_name"]
# the latency histograms keep vLLM's buckets, stated once in vllm_metrics
TTFT_BUCKETS, ITL_BUCKETS = vllm_metrics.TTFT_BUCKETS, vllm_metrics.ITL_BUCKETS
REQUEST_TIME_BUCKETS = vllm_metrics.REQUEST_TIME_BUCKETS
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]

TIME_TO_FIRST_TOKEN = Histogram("gapserve:time_to_first_token_seconds",
                                "Time to first token, as the frontend sees it.", _M,
                                buckets=TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("gapserve:inter_token_latency_seconds",
                                "Time between consecutive output tokens.", _M,
                                buckets=ITL_BUCKETS)
E2E_REQUEST_LATENCY = Histogram("gapserve:e2e_request_latency_seconds",
                                "End-to-end request latency.", _M, buckets=REQUEST_TIME_BUCKETS)
PROMPT_TOKENS = Counter("gapserve:prompt_tokens", "Prompt tokens processed.", _M)
GENERATION_TOKENS = Counter("gapserve:generation_tokens", "Output tokens generated.", _M)
SCHEDULER_SESSIONS_LOST = Counter(
    "gapserve:scheduler_sessions_lost", "Times the session to the scheduler was lost "
    "(docs/resilience.md).", _M)
SESSION_BATCHED_REQUESTS = Counter(
    "gapserve:frontend_session_batched_requests",
    "Adds and aborts sent to the scheduler in one message behind an earlier one, "
    "because they queued up while the session stream was busy.", _M)
REQUESTS_RESUMED = Counter(
    "gapserve:requests_resumed", "Open requests re-submitted as continuations to a new "
    "scheduler session after the old one was lost.", _M)
REQUEST_PROMPT_TOKENS = Histogram("gapserve:request_prompt_tokens",
                                  "Prompt tokens per finished request.", _M,
                                  buckets=TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = Histogram("gapserve:request_generation_tokens",
                                      "Output tokens per finished request.", _M,
                                      buckets=TOKEN_BUCKETS)
REQUEST_MAX_TOKENS = Histogram("gapserve:request_params_max_tokens",
                               "The max_tokens parameter of requests.", _M,
                               buckets=TOKEN_BUCKETS)
REQUEST_SUCCESS = Counter("gapserve:request_success", "Finished requests, by finish reason.",
                          _M + ["finished_reason"])
REQUEST_ERRORS = Counter("gapserve:request_errors",
                         "Requests that ended in an error, by status code.", _M + ["code"])
# structured outputs and tool calling (docs/tool_calling.md): per HTTP request admitted
STRUCTURED_OUTPUT_REQUESTS = Counter(
    "gapserve:structured_output_requests", "Requests with a structured output, by kind (json, "
    "json_object, regex, choice, grammar) and the field that asked (response_format, "
    "structured_outputs, guided, tool_choice).", _M + ["kind", "source"])
TOOL_CHOICE_REQUESTS = Counter(
    "gapserve:tool_choice_requests", "Chat requests with tools, by tool_choice (none, auto, "
    "required, named).", _M + ["tool_choice"])

_tracer = get_tracer("gapserve.frontend")


@dataclass(slots=True)
class _Series:
    """One model's labelled children, looked up once (on_tokens runs per token)."""

    ttft: Any
    itl: Any
    e2e: Any
    prompt_tokens: Any
    generation_tokens: Any
    request_prompt_tokens: Any
    request_generation_tokens: Any
    max_tokens: Any


@functools.cache
def _series(m: str) -> _Series:
    return _Series(TIME_TO_FIRST_TOKEN.labels(m), INTER_TOKEN_LATENCY.labels(m),
                   E2E_REQUEST_LATENCY.labels(m), PROMPT_TOKENS.labels(m),
                   GENERATION_TOKENS.labels(m), REQUEST_PROMPT_TOKENS.labels(m),
                   REQUEST_GENERATION_TOKENS.labels(m), REQUEST_MAX_TOKENS.labels(m))


@dataclass(slots=True)
class RequestTracker:
    choice: Choice
    model_name: str
    span: trace.Span
    vllm: vllm_metrics.VllmSeries
    done: bool = False

    @classmethod
    def start(cls, choice: Choice, model_name: str, incoming: Any = None,
              operation: str = "text_completion", max_model_len: int = 0) -> RequestTracker:
        """Open the request's root span (server kind), continuing the caller's
        trace when `incoming` headers or gRPC metadata carry a traceparent;
        max_model_len sizes the vLLM token buckets (vllm_metrics.series)."""
        params = choice.params
        span = _tracer.start_span(
            f"{operation} {model_name}", context=extract_context(incoming), kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "gapserve",
                "gen_ai.request.id": choice.req_id,
                "gen_ai.request.model": model_name,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.top_k": params.top_k,
                "gen_ai.request.presence_penalty": params.presence_penalty,
                "gen_ai.request.frequency_penalty": params.frequency_penalty,
                "gen_ai.usage.input_tokens": choice.num_prompt_tokens,
            })
        if params.seed is not None:
            span.set_attribute("gen_ai.request.seed", params.seed)
        _series(model_name).max_tokens.observe(params.max_tokens)
        vllm = vllm_metrics.series(model_name, max_model_len)
        vllm.max_tokens.observe(params.max_tokens)
        return cls(choice, model_name, span, vllm)

    @property
    def req_id(self) -> str:
        return self.choice.req_id

    def activate(self):
        """Make the span current (logs carry its trace id) without ending it on exit."""
        return trace.use_span(self.span, end_on_exit=False)

    def carrier(self) -> dict[str, str]:
        """W3C trace context of this request, for the call to the scheduler."""
        return context_carrier(trace.set_span_in_context(self.span))

    def metadata(self) -> list[tuple[str, str]]:
        """The same, as gRPC metadata pairs."""
        return list(self.carrier().items())

    def on_output(self, out) -> None:
        """A scheduler output: its request's vllm:* series are its replica's engine's."""
        self.vllm = vllm_metrics.for_request(self.choice.req_id, self.vllm)

    def on_tokens(self, num_new_tokens: int) -> None:
        """The choice just recorded num_new_tokens more for the client (0: ignored)."""
        if num_new_tokens <= 0 or self.done:
            return
        c, m = self.choice, self.model_name
        if c.num_output_tokens == num_new_tokens:  # these are the first
            _series(m).ttft.observe(c.first_token_s - c.arrival_s)
            self.vllm.ttft.observe(c.first_token_s - c.arrival_s)
            self.span.add_event("first_token")
        else:
            gap_s = c.last_token_s - c.previous_token_s
            # vLLM's: one observation per output, however many tokens it carries
            self.vllm.itl.observe(gap_s)
            # tokens that arrive together share the gap since the previous batch
            for _ in range(num_new_tokens):
                _series(m).itl.observe(gap_s / num_new_tokens)
        _series(m).generation_tokens.inc(num_new_tokens)
        self.vllm.generation_tokens.inc(num_new_tokens)

    def finish(self, reason: FinishReason) -> None:
        """The request ended normally (stop, length) or was aborted."""
        if self.done:
            return
        self.done = True
        c, m = self.choice, self.model_name
        name = finish_reason_name(reason)
        e2e = time.monotonic() - c.arrival_s
        _series(m).e2e.observe(e2e)
        _series(m).prompt_tokens.inc(c.num_prompt_tokens)
        _series(m).request_prompt_tokens.observe(c.num_prompt_tokens)
        _series(m).request_generation_tokens.observe(c.num_output_tokens)
        REQUEST_SUCCESS.labels(m, name).inc()
        first = c.first_token_s
        self.vllm.finished(name, e2e, None if first is None else first - c.arrival_s,
                           0.0 if first is None else c.last_token_s - first,
                           c.num_prompt_tokens, c.num_output_tokens,
                           c.queue_time_s, c.prefill_time_s, c.num_cached_tokens)
        self.span.add_event("finished", {"reason": name})
        self.span.set_attributes({
            "gen_ai.usage.output_tokens": c.num_output_tokens,
            "gen_ai.response.finish_reasons": [name],
            "gapserve.request.num_preemptions": c.num_preemptions,
            "gapserve.request.num_cached_tokens": c.num_cached_tokens,
        })
        self.span.end()

    def fail(self, code: str, message: str) -> None:
        """The request ended in an error (a gRPC status code name, e.g. UNAVAILABLE)."""
        if self.done:
            return
        self.done = True
        REQUEST_ERRORS.labels(self.model_name, code).inc()
        self.span.set_attribute("error.type", code)
        self.span.set_status(Status(StatusCode.ERROR, message))
        self.span.end()
