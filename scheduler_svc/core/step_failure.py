"""What the scheduler does with a request that breaks the workers: a step that
failed (the worker answered it with its exception), or a worker that died with the
request in flight (a crash in the step: every step in flight counts as failed).
Retry once, then isolate, then fail only the culprit (docs/resilience.md, "A
request that fails by itself"). Pure rules, no network:
tests/scheduler/test_step_failure_rules.py; the engine carries them out.

After any failed step every request is recomputed, as after a worker loss (the
worker drops its requests: their state may be half changed), so the rules only
decide who is failed and who runs alone:

- Every request in a failed step gets a strike and remembers where the step would
  have taken it (`fail_at`, its computed tokens after the step). A successful step
  that computes it up to `fail_at` clears it: it got past the point that failed.
- A failed step that held one request: the request's second strike fails it (it
  was retried once). A step that held several: the requests on their second strike
  (they failed, were retried together, and failed again) become suspects.
- Suspects run alone, one at a time, in admission order (`solo()`): each until it
  is cleared (it was innocent; the next one goes) or fails alone (the culprit).
  Everyone else waits meanwhile; requests cleared already keep their KV.
- A bound: a request in MAX_FAILED_STEPS failed steps without a new token between
  them is failed, whatever the batch (a safety net: a loop that makes no progress
  ends). A request running alone samples a token once recomputed, so a failure that
  only some batches trigger still progresses a token a round.
- A worker loss with steps in flight is one failed step holding every request in
  them: so a request in flight each time the worker dies, twice in a row, alone, is
  failed, and one that kills it batched is found by running the suspects alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.request import Request, RequestStatus

MAX_FAILED_STEPS = 4  # failed steps a request may be in without a new token between


def failed_alone(error: str) -> str:
    return (f"the worker failed a step of this request alone, after retrying it once: "
            f"{error}")


def failed_too_often(count: int, error: str) -> str:
    return (f"this request was in {count} failed steps without a new token between "
            f"them: {error}")


def lost_in_flight(error: str) -> str:
    return f"the worker died with this request in flight ({error})"


class StepFailures:
    """The strikes and the suspects; the Scheduler holds one."""

    def __init__(self) -> None:
        self.suspects: list[Request] = []  # run alone, one at a time, in this order
        self._marked: set[Request] = set()  # requests with a strike

    # ---------------------------------------------------------------- failures

    def step_failed(self, step: dict[str, InFlight], error: str) -> list[tuple[Request, str]]:
        """The strikes of one failed step; returns the requests to fail, with why."""
        entries = [e for e in step.values() if not e.request.is_finished]
        alone = len(entries) == 1
        culprits = []
        for entry in entries:
            request = self._mark(entry)
            request.num_strikes += 1
            if len(request.output_token_ids) != request.num_output_at_failure:  # progress
                request.num_output_at_failure = len(request.output_token_ids)
                request.num_failed_steps = 0
            request.num_failed_steps += 1
            if alone and request.num_strikes >= 2:
                culprits.append((request, failed_alone(error)))
            elif request.num_failed_steps >= MAX_FAILED_STEPS:
                culprits.append((request, failed_too_often(request.num_failed_steps, error)))
            elif not alone and request.num_strikes >= 2 and request not in self.suspects:
                self.suspects.append(request)
        return culprits

    def worker_lost(self, in_flight: Iterable[dict[str, InFlight]],
                    error: str) -> list[tuple[Request, str]]:
        """A worker died with these steps in flight: one failed step of all their
        requests (the oldest step's entry: its inputs are all committed, so the
        recompute reaches its point). Returns those to fail."""
        merged: dict[str, InFlight] = {}
        for step in in_flight:  # oldest first
            for req_id, entry in step.items():
                merged.setdefault(req_id, entry)
        return self.step_failed(merged, lost_in_flight(error)) if merged else []

    def _mark(self, entry: InFlight) -> Request:
        request = entry.request
        # the step's real input tokens, not draft slots (its own, or the step before's
        # rejected since): the recompute of the committed tokens reaches this point
        real_end = entry.num_computed_after - entry.num_drafts \
            - (request.num_rejected_tokens - entry.rejected_before)
        request.fail_at = max(request.fail_at, real_end)
        self._marked.add(request)
        return request

    # ---------------------------------------------------------------- progress

    def step_succeeded(self, step: dict[str, InFlight]) -> None:
        """Clear the requests this step computed past the point that failed."""
        if not self._marked:
            return
        for entry in step.values():
            request = entry.request
            if request in self._marked and request.status is RequestStatus.RUNNING \
                    and request.num_preemptions == entry.num_preemptions \
                    and entry.num_computed_after >= request.fail_at:
                self._clear(request)

    def forget(self, request: Request) -> None:
        """The request finished (or failed): nothing to remember."""
        if request in self._marked:
            self._clear(request)

    def _clear(self, request: Request) -> None:
        request.num_strikes = request.fail_at = 0
        self._marked.discard(request)
        if request in self.suspects:
            self.suspects.remove(request)

    # ---------------------------------------------------------------- isolation

    @property
    def isolating(self) -> bool:
        return bool(self.suspects)

    def solo(self) -> Request | None:
        """The suspect that runs alone now: the first one whose grammar is ready (None
        while every suspect waits for its grammar: then nothing runs)."""
        return next((r for r in self.suspects if not r.deferred), None)
