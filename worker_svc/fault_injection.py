"""Fault injection for resilience drills and tests (docs/resilience.md): with
GAPSERVE_FAULT_STOP_AFTER_STEPS=N in its environment, a worker stops itself with
SIGSTOP after its N-th step (counted over the process, once), exactly as a hung or
frozen worker would look to the scheduler. Off unless the variable is set; there is
no flag on purpose, so it cannot be switched on by a typo on a production command
line. The variable is read once at start (shared.config.fault_stop_after_steps, by the
worker's main into WorkerConfig, then the compute plan) and the hook bound then: a
worker without it runs a no-op.

GAPSERVE_FAULT_FAIL_ON_TOKEN=<id> makes the worker raise (InjectedFault) in every step
whose scheduled tokens include that id, before the step's forward pass: a request
holding the token fails every step it is in, alone or batched, exactly as a request
that breaks the forward pass would (docs/resilience.md, "A request that fails by
itself"). Read the same way (shared.config.fault_fail_on_token)."""

from __future__ import annotations

import os
import signal
from typing import Callable, Sequence


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


class InjectedFault(RuntimeError):
    """The step failure GAPSERVE_FAULT_FAIL_ON_TOKEN asks for."""


class FailOnToken:
    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def check(self, step_id: int, states: Sequence, num_scheduled: Sequence[int]) -> None:
        """Raise if a request's scheduled tokens (its token ids from its own computed
        count, as many as the step schedules) include the token."""
        for state, n in zip(states, num_scheduled):
            start = state.num_computed_tokens
            if self.token_id in state.token_ids[start:start + n]:
                raise InjectedFault(
                    f"injected fault (GAPSERVE_FAULT_FAIL_ON_TOKEN={self.token_id}): step "
                    f"{step_id} schedules token {self.token_id} for request {state.req_id}")


def _no_check(step_id: int, states: Sequence, num_scheduled: Sequence[int]) -> None:
    pass


def before_step_hook(fail_on_token: int | None) -> Callable[[int, Sequence, Sequence[int]], None]:
    """What the worker calls with a step's requests and their scheduled token counts,
    before the forward pass."""
    return _no_check if fail_on_token is None else FailOnToken(fail_on_token).check
