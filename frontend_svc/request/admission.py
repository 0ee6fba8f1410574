"""Bounded admission (--max-queued-requests): the frontend holds at most the
scheduler's max-num-seqs plus that many requests (choices) at once; a request
that would pass the bound is refused whole with RESOURCE_EXHAUSTED (HTTP 429
with Retry-After), before any of its choices is sent, so nothing is queued."""

from __future__ import annotations

import contextlib

import grpc
from prometheus_client import Gauge

from frontend_svc.request.caps import REJECTED, too_many_choices
from frontend_svc.errors import EngineError

IN_FLIGHT = Gauge("gapserve:frontend_requests_in_flight",
                  "Requests (choices) this frontend has admitted and not yet finished.")
RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class Admission:
    def __init__(self, max_queued_requests: int) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_num_seqs = 0  # the scheduler's, learnt when the session opens
        self.in_flight = 0

    @property
    def limit(self) -> int:
        return self.max_num_seqs + self.max_queued_requests

    def check(self, num_choices: int) -> None:
        """Raise EngineError(429) if `num_choices` would not fit now: called before
        parsing and tokenizing too, so an overload is refused at the least cost."""
        if num_choices > self.limit:  # retrying would not help: not a 429
            raise too_many_choices(num_choices, self.limit, "--max-queued-requests plus "
                                   "the scheduler's --max-num-seqs")
        if self.in_flight + num_choices > self.limit:
            REJECTED.labels("queue_full").inc()
            raise EngineError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the server is at capacity ({self.in_flight} requests in "
                              f"flight, limit {self.limit}); retry later")

    @contextlib.contextmanager
    def admit(self, num_choices: int):
        """Hold `num_choices` places for the duration, or raise EngineError(429)."""
        self.check(num_choices)
        self.in_flight += num_choices
        IN_FLIGHT.set(self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= num_choices
            IN_FLIGHT.set(self.in_flight)
