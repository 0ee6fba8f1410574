"""Every telemetry hook of the frontend in one place: the root span and metrics
of each request (frontend_svc/metrics.py), logging set-up, /metrics (scrape: the
gapserve:* and vllm:* series, frontend_svc/vllm_metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.telemetry import get_logger, setup_telemetry

from frontend_svc.metrics import RequestTracker
from frontend_svc.vllm_metrics import scrape

log = get_logger(component="frontend")


@dataclass(slots=True)
class Observer:
    model_name: str

    def start(self, choice, engine=None) -> RequestTracker:
        info = None if engine is None else engine.model_info
        return RequestTracker.start(choice.req_id, self.model_name, choice.params,
                                    len(choice.inp.prompt_token_ids), choice.incoming,
                                    operation=choice.operation,
                                    max_model_len=info.max_model_len if info else 0)

    def finish(self, tracker: RequestTracker, state) -> None:
        tracker.finish(state.finish_reason, num_preemptions=state.num_preemptions,
                       num_cached_tokens=state.num_cached_tokens)

    def fail(self, tracker: RequestTracker, code: str, message: str) -> None:
        tracker.fail(code, message)
        if code != "CANCELLED":
            with tracker.activate():  # the line carries the request's trace id
                log.warning("request failed", request_id=tracker.req_id, code=code,
                            message=message)


def setup(args) -> None:
    setup_telemetry("frontend", otlp_endpoint=args.otlp_traces_endpoint,
                    log_format=args.log_format, log_level=args.log_level)


__all__ = ["Observer", "setup", "scrape", "log"]
