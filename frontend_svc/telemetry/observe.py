"""Every telemetry hook of the frontend in one place: the root span and metrics
of each request (frontend_svc/telemetry/metrics.py), logging set-up (/metrics is frontend_svc/telemetry/vllm_metrics.py's scrape)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.telemetry import get_logger, setup_telemetry

from frontend_svc.telemetry.metrics import (
    STRUCTURED_OUTPUT_REQUESTS, TOOL_CHOICE_REQUESTS, RequestTracker)

log = get_logger(component="frontend")


@dataclass(slots=True)
class Observer:
    model_name: str

    def start(self, choice, engine=None) -> RequestTracker:
        info = None if engine is None else engine.model_info
        tracker = RequestTracker.start(choice, self.model_name, choice.incoming,
                                       operation=choice.operation,
                                       max_model_len=info.max_model_len if info else 0)
        tracker.span.set_attributes(constraint_attributes(choice.inp))
        return tracker

    def constrained(self, resp_id: str, inp) -> None:
        """One HTTP request's structured output and tool_choice: counted, and said in
        one log line (with the compile time: a cache hit is ~0)."""
        attrs = constraint_attributes(inp)
        if not attrs:
            return
        if inp.constraint is not None:
            STRUCTURED_OUTPUT_REQUESTS.labels(self.model_name, inp.constraint.spec.kind,
                                              inp.constraint.source).inc()
        if inp.tool_plan is not None:
            TOOL_CHOICE_REQUESTS.labels(self.model_name, inp.tool_plan.label).inc()
        log.info("constrained request", request_id=resp_id,
                 structured_output=attrs.get("gapserve.request.structured_output"),
                 source=inp.constraint.source if inp.constraint else None,
                 tool_choice=attrs.get("gapserve.request.tool_choice"),
                 compile_ms=round(inp.compile_s * 1e3, 2),
                 cache_hit=attrs.get("gapserve.request.structured_output.cache_hit"))

    def finish(self, tracker: RequestTracker) -> None:
        tracker.finish(tracker.choice.finish_reason)

    def fail(self, tracker: RequestTracker, code: str, message: str) -> None:
        tracker.fail(code, message)
        if code != "CANCELLED":
            with tracker.activate():  # the line carries the request's trace id
                log.warning("request failed", request_id=tracker.req_id, code=code,
                            message=message)


def constraint_attributes(inp) -> dict[str, str | float | bool]:
    """Span attributes naming a request's structured-output kind and tool_choice,
    and what compiling its grammar at the frontend cost: the milliseconds (the
    request waited that long before it was queued) and whether the compiled-grammar
    cache had it. (The time it then waits deferred while rank 0 compiles is known
    only to the scheduler: it is part of the request's queue time there,
    gapserve:request_queue_time_seconds.)"""
    out: dict[str, str | float | bool] = {}
    constraint = getattr(inp, "constraint", None)
    plan = getattr(inp, "tool_plan", None)
    if constraint is not None:
        out["gapserve.request.structured_output"] = constraint.spec.kind
        out["gapserve.request.structured_output.source"] = constraint.source
        out["gapserve.request.structured_output.compile_ms"] = round(inp.compile_s * 1e3, 3)
        if inp.cache_hit is not None:
            out["gapserve.request.structured_output.cache_hit"] = inp.cache_hit
    if plan is not None:
        out["gapserve.request.tool_choice"] = plan.label
    return out


def setup(args) -> None:
    setup_telemetry("frontend", otlp_endpoint=args.otlp_traces_endpoint,
                    log_format=args.log_format, log_level=args.log_level)


__all__ = ["Observer", "setup", "log"]
