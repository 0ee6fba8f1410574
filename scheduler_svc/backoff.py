"""The scheduler's worker-reconnect loop paces itself and its log (docs/resilience.md):
each failed round, and each loss that comes before a step was applied since the last
reconnect (a worker that dies on every step), waits twice as long as the one
before, and a burst of them is logged once, then at most every LOG_EVERY_S, with
how many were left out; every one is counted in a metric."""

from __future__ import annotations

import time
from collections.abc import Callable

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 2.0
LOG_EVERY_S = 30.0


class Backoff:
    def __init__(self, first_s: float = FIRST_DELAY_S, max_s: float = MAX_DELAY_S) -> None:
        self.first_s, self.max_s = first_s, max_s
        self.delay_s = first_s

    def next(self) -> float:
        """The wait before this retry; the next one waits twice as long, up to max_s."""
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, self.max_s)
        return delay

    def reset(self) -> None:
        """Progress was made (a step was applied): the next loss retries at once."""
        self.delay_s = self.first_s


class BurstLog:
    """Whether to log one more event of a burst: the first yes, then at most one every
    interval_s. `event()` returns how many events the line stands for (None: stay
    quiet); `end()` closes the burst and returns its size."""

    def __init__(self, interval_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self.count = 0  # events in this burst
        self._unlogged = 0  # events since the last line
        self._last_s: float | None = None

    def event(self) -> int | None:
        self.count += 1
        self._unlogged += 1
        now = self._clock()
        if self._last_s is not None and now - self._last_s < self.interval_s:
            return None
        self._last_s, n, self._unlogged = now, self._unlogged, 0
        return n

    def end(self) -> int:
        count, self.count, self._unlogged, self._last_s = self.count, 0, 0, None
        return count
