"""The capacity diagnosis of docs/scheduling.md ("Observability"), evaluated live.

That table, whose problem rows all have requests waiting for capacity; which
limit stopped admission is read from the scheduler's `admission_blocked_by`, not
guessed from the counts:

| waiting | preemptions | admission blocked by | diagnosis                              |
|---------|-------------|----------------------|----------------------------------------|
| 0       | any         | any                  | healthy                                |
| > 0     | rising      | any                  | past capacity: shed load or scale out  |
| > 0     | 0           | max_num_seqs         | concurrency-capped: raise the cap      |
| > 0     | 0           | kv_cache             | memory-capped at admission             |
| > 0     | 0           | token_budget         | budget-capped: prefills use the budget |
| > 0     | 0           | nothing (yet)        | healthy: arrived since the last step   |

"rising" = at least one preemption inside the window (default 30 s). Only requests
waiting for capacity count; a request that is not ready is not a capacity problem. With
nobody waiting, past preemptions are over (a preempted request waits until it resumes),
so the window alone never keeps a drained server "past capacity". RUNNING at
`max_num_seqs` reads concurrency-capped whatever the last step's reason.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class Diagnosis(str, enum.Enum):
    HEALTHY = "healthy"
    CONCURRENCY_CAPPED = "concurrency_capped"
    MEMORY_CAPPED = "memory_capped"
    BUDGET_CAPPED = "budget_capped"
    PAST_CAPACITY = "past_capacity"


SUMMARY = {
    Diagnosis.HEALTHY: "healthy: every request is running",
    Diagnosis.CONCURRENCY_CAPPED:
        "concurrency-capped: RUNNING is at --max-num-seqs and requests queue behind it",
    Diagnosis.MEMORY_CAPPED:
        "memory-capped at admission: requests wait because the KV cache has no free blocks",
    Diagnosis.BUDGET_CAPPED:
        "budget-capped: requests wait because running prefills take the step's whole "
        "token budget",
    Diagnosis.PAST_CAPACITY:
        "past capacity: requests are preempted by recomputation, so throughput is falling",
}

LEVER = {
    Diagnosis.HEALTHY: "nothing to do",
    Diagnosis.CONCURRENCY_CAPPED:
        "raise --max-num-seqs if KV memory allows (KV usage well below 1)",
    Diagnosis.MEMORY_CAPPED:
        "give the KV cache more memory (--gpu-memory-utilization, --kv-cache-memory) "
        "or shorten requests (--max-model-len); otherwise scale out",
    Diagnosis.BUDGET_CAPPED:
        "raise --max-num-batched-tokens (longer steps: more inter-token latency, shorter "
        "time to first token), or cap long prompts with --long-prefill-token-threshold",
    Diagnosis.PAST_CAPACITY:
        "shed load or scale out; short of that, give the KV cache more memory, "
        "lower --max-num-seqs or --max-num-batched-tokens",
}


def diagnose(running: int, max_num_seqs: int, waiting: int, preemptions_in_window: int,
             blocked_by: str | None = None) -> Diagnosis:
    """The table above, as a pure function of one reading."""
    if waiting <= 0:
        return Diagnosis.HEALTHY
    if preemptions_in_window > 0 or blocked_by == "preemption":
        return Diagnosis.PAST_CAPACITY
    if running >= max_num_seqs or blocked_by == "max_num_seqs":
        return Diagnosis.CONCURRENCY_CAPPED
    if blocked_by == "kv_cache":
        return Diagnosis.MEMORY_CAPPED
    if blocked_by == "token_budget":
        return Diagnosis.BUDGET_CAPPED
    return Diagnosis.HEALTHY


@dataclass(slots=True)
class CapacityReading:
    """What the diagnosis reads from the scheduler at one moment."""

    running: int
    waiting: int  # waiting for capacity (not counting requests that are not ready)
    waiting_not_ready: int
    preemptions_total: int
    kv_cache_usage: float  # 0..1
    admission_blocked_by: str | None = None  # why the last step admitted no more


@dataclass(slots=True)
class CapacityMonitor:
    """Keeps the preemption counter's history over a sliding window, so the
    diagnosis says "rising" only while preemptions keep happening."""

    max_num_seqs: int
    window_s: float = 30.0
    # (time, cumulative preemptions), appended only when the count changes
    _points: deque[tuple[float, int]] = field(default_factory=deque)
    _last: CapacityReading | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")

    def observe(self, reading: CapacityReading, now_s: float) -> None:
        """Record a reading (cheap: call it every step and on every status query)."""
        if not self._points or self._points[-1][1] != reading.preemptions_total:
            self._points.append((now_s, reading.preemptions_total))
        self._last = reading
        self._trim(now_s)

    def _trim(self, now_s: float) -> None:
        # keep one point at or before the window's start: it is the baseline
        while len(self._points) >= 2 and self._points[1][0] <= now_s - self.window_s:
            self._points.popleft()

    def preemptions_in_window(self, now_s: float) -> int:
        """Preemptions since the window's start (or since monitoring began)."""
        if self._last is None:
            return 0
        self._trim(now_s)
        return self._last.preemptions_total - self._points[0][1]

    def status(self, now_s: float) -> dict[str, Any]:
        """The dict behind GetStatus, GET /v1/status and `gapserve status`."""
        r = self._last or CapacityReading(0, 0, 0, 0, 0.0)
        in_window = self.preemptions_in_window(now_s)
        d = diagnose(r.running, self.max_num_seqs, r.waiting, in_window,
                     r.admission_blocked_by)
        return {
            "running": r.running,
            "max_num_seqs": self.max_num_seqs,
            "waiting": r.waiting,
            "waiting_by_reason": {"capacity": r.waiting, "not_ready": r.waiting_not_ready},
            "preemptions_total": r.preemptions_total,
            "preemptions_in_window": in_window,
            "preemption_rate_per_s": in_window / self.window_s,
            "window_s": self.window_s,
            "kv_cache_usage": r.kv_cache_usage,
            "admission_blocked_by": r.admission_blocked_by,
            "diagnosis": d.value,
            "summary": SUMMARY[d],
            "lever": LEVER[d],
        }
