"""A step in flight: what the scheduler remembers of each request's share of a step
until the worker answers, and the error an answer that contradicts it raises
(docs/scheduling.md, "async scheduling" and "worker loss")."""

from __future__ import annotations

from typing import NamedTuple

from scheduler_svc.core.request import Request

# A third step would let a preempted request be re-admitted before the output of its
# last in-flight step is applied, and the worker's token ids would then differ from ours.
MAX_STEPS_IN_FLIGHT = 2


class WorkerOutputError(ValueError):
    """A step's answer that contradicts the scheduler (a stop decided otherwise, a token
    count or request it did not schedule, another step): raised before anything
    changes. `sides` maps each request named to both sides' tokens, for the log; the
    engine recovers from it as from a lost worker (docs/scheduling.md)."""

    def __init__(self, message: str, sides: dict[str, dict] | None = None) -> None:
        super().__init__(message)
        self.sides = sides or {}


def both_sides(entry: InFlight, sampled: list[int]) -> dict:
    request = entry.request
    return {"worker": list(sampled), "scheduler_output_tail": request.output_token_ids[-8:],
            "scheduler_num_output": len(request.output_token_ids),
            "scheduled_passes": entry.max_sampled if entry.samples else 0}


class InFlight(NamedTuple):
    """One request's share of a step in flight."""

    request: Request
    samples: bool  # the step reaches the end of its tokens and samples one
    num_computed_after: int  # its num_computed_tokens once the step is done
    num_preemptions: int  # at scheduling; a preemption since voids the step's KV
    max_sampled: int = 1  # tokens it may sample: the step's forward passes (multi-step)
    num_drafts: int = 0  # draft slots (speculative decoding): it may commit 1 + these
    rejected_before: int = 0  # the request's num_rejected_tokens at scheduling
