"""Logs: structlog over the standard library, so our own lines and those of grpc,
uvicorn and friends come out in one format: JSON lines, or a readable console
format when attached to a terminal. Every line carries the service, and the
trace and span ids when a span is current; callers bind the request id.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import IO, Any

import structlog
from opentelemetry import trace

LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(slots=True)
class _LogState:
    service: str = "gapserve"
    handler: logging.Handler | None = None


_state = _LogState()


def _add_service(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    event.setdefault("service", _state.service)
    return event


def _add_trace_ids(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


def check_log_settings(log_format: str, log_level: str) -> None:
    if log_format.lower() not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, "
                         f"got {log_format!r}")
    if log_level.lower() not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, "
                         f"got {log_level!r}")


def setup_logging(service_name: str, log_format: str = "auto", log_level: str = "info",
                  stream: IO[str] | None = None) -> None:
    """Configure structlog and the root logger; bad arguments change nothing."""
    check_log_settings(log_format, log_level)
    fmt = log_format.lower()
    level = log_level.lower()
    stream = stream if stream is not None else sys.stderr
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"

    _state.service = service_name
    shared_processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        _add_service,
        _add_trace_ids,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if fmt == "json":
        renderer: Any = structlog.processors.JSONRenderer()
        shared_processors.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=getattr(stream, "isatty", lambda: False)())

    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared_processors,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,  # setup may run again (tests, reconfiguration)
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared_processors,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    ))
    root = logging.getLogger()
    if _state.handler is not None:
        root.removeHandler(_state.handler)
    root.addHandler(handler)
    root.setLevel(level.upper())
    _state.handler = handler


def get_logger(**bound: Any) -> Any:
    """A logger with these key/values on every line, e.g. get_logger(request_id=rid)."""
    # a lazy proxy: a logger made at import time still follows a later setup
    return structlog.get_logger("gapserve", **bound)


def reset_logging() -> None:
    """Undo setup_logging (tests): structlog's defaults, our handler removed."""
    if _state.handler is not None:
        logging.getLogger().removeHandler(_state.handler)
        _state.handler = None
    logging.getLogger().setLevel(logging.WARNING)
    structlog.reset_defaults()
