"""Fault injection for resilience drills and tests (docs/resilience.md): with
GAPSERVE_FAULT_STOP_AFTER_STEPS=N in its environment, a worker stops itself with
SIGSTOP after its N-th step (counted over the process, once), exactly as a hung or
frozen worker would look to the scheduler. Off unless the variable is set; there is
no flag on purpose, so it cannot be switched on by a typo on a production command
line. The variable is read once at start (shared.config.fault_stop_after_steps, by the
worker's main into WorkerConfig, then the compute plan) and the hook bound then: a worker without it runs a no-op."""

from __future__ import annotations

import os
import signal
from typing import Callable


class StopAfterSteps:
    def __init__(self, steps: int) -> None:
        self.remaining: int | None = steps

    def step_done(self) -> None:
        if self.remaining is None:
            return
        self.remaining -= 1
        if self.remaining == 0:
            self.remaining = None  # once: after SIGCONT the worker carries on
            os.kill(os.getpid(), signal.SIGSTOP)


def _nothing() -> None:
    pass


def after_step_hook(stop_after_steps: int | None) -> Callable[[], None]:
    """What the worker calls after every step it executes, whichever stream it came on."""
    return _nothing if stop_after_steps is None else StopAfterSteps(stop_after_steps).step_done
