"""Fault injection for resilience drills and tests (docs/resilience.md): with
GAPSERVE_FAULT_STOP_AFTER_STEPS=N in its environment, a worker stops itself with
SIGSTOP after its N-th step (counted over the process, once), exactly as a hung or frozen worker would look to the
scheduler. Off unless the variable is set; there is no flag on purpose, so it
cannot be switched on by a typo on a production command line."""

from __future__ import annotations

import os
import signal

ENV = "GAPSERVE_FAULT_STOP_AFTER_STEPS"


class StopAfterSteps:
    def __init__(self, environ=os.environ) -> None:
        value = environ.get(ENV, "")
        self.remaining = int(value) if value.strip() else None

    def step_done(self) -> None:
        if self.remaining is None:
            return
        self.remaining -= 1
        if self.remaining == 0:
            self.remaining = None  # once: after SIGCONT the worker carries on
            os.kill(os.getpid(), signal.SIGSTOP)


_process_fault: StopAfterSteps | None = None


def step_done() -> None:
    """Called after every step the process executes, whichever stream it came on."""
    global _process_fault
    if _process_fault is None:
        _process_fault = StopAfterSteps()
    _process_fault.step_done()
