"""The verify pass's sampling rows (docs/spec_decode.md, "Verification").

A request with m drafts gets m + 1 logits rows in the verify pass: row j is the
target's distribution after its tokens and the first j drafts. Each row is sampled by
the ordinary sampler (worker_svc/sampler.py) as the request would be sampled at that
output position if the j drafts before it had been accepted: `DraftRow` is the
request's state seen from there (its output count, and with penalties its output
counts, include those drafts). Then the drafts are accepted while each equals the
token sampled at its row, and the committed tokens are the sampled ones up to and
including the first that differs (or the bonus row's, when all were accepted).

For a greedy row the sample is the argmax: greedy verification. For a sampled row the
sampler's exponential race with the position's own noise is `coupled_verify`'s rule
(worker_svc/spec/rejection.py): Leviathan et al.'s rejection rule for one-hot drafts
(n-gram and greedy draft models propose one-hot), so the output distribution is the
target's; and a seeded request's noise is a pure function of (seed, output position),
so its tokens are exactly the ones sampling without drafts gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.types import SamplingParams
from worker_svc.worker_request import WorkerRequest


@dataclass(slots=True)
class VerifyPass:
    """A step's drafts as the speculator verifies them: per request of the pass (in
    its order) the drafts proposed and the slots the scheduler gave (at least as
    many); the proposer hears what each request accepted."""
    drafts: list[list[int]]
    slots: list[int]
    step_id: int
    proposer: object

    def rows(self, states: list[WorkerRequest], sample_rows: list[int]) -> list:
        """The pass's sampling rows: verify_rows of each sampling request, in order."""
        return [row for i in sample_rows for row in verify_rows(states[i], self.drafts[i])]

    def accept(self, i: int, state: WorkerRequest, sampled: list[int]) -> int:
        """How many of request i's drafts its rows' samples accept. A request with
        slots computed 1 + accepted of its positions, and remembers the slots it
        rejected, which the scheduler may still count in the next step (step_check)."""
        drafts = self.drafts[i]
        a = accepted(drafts, sampled)
        if self.slots[i]:
            state.num_computed_tokens -= len(drafts) - a  # the rejected drafts' positions
            state.last_rejection = (self.step_id, self.slots[i] - a)
            self.proposer.verified(state, len(state.token_ids), len(drafts), a)
        return a


class DraftMask:
    """The grammar's allowed set at a verify row j > 0: the request's matcher after
    its drafts before the row, computed while they were consumed (then rolled back)."""

    __slots__ = ("mask",)
    failed = False

    def __init__(self, mask: np.ndarray) -> None:
        self.mask = mask

    def fill(self, row: np.ndarray) -> None:
        row[:] = self.mask


@dataclass(slots=True)
class DraftRow:
    """A request's state as the sampler sees it at its verify row j > 0."""
    params: SamplingParams
    num_output_tokens: int
    prompt_mask: torch.Tensor | None
    output_counts: torch.Tensor | None
    has_penalties: bool
    grammar: DraftMask | None = None


def verify_rows(state: WorkerRequest, drafts: list[int]) -> list:
    """The m + 1 sampling rows of a request with drafts: the state itself for row 0,
    a DraftRow after each accepted-draft prefix for the others. With a grammar (rank
    0), row j's mask is the matcher's after drafts[:j], which are valid (the
    speculator keeps only a grammar-valid prefix: speculator.py); the matcher is
    rolled back to the committed tokens before anything samples."""
    rows: list = [state]
    counts = state.output_counts
    masks = _draft_masks(state.grammar, drafts) if state.grammar is not None else None
    for j, draft in enumerate(drafts):
        if counts is not None:  # penalties see the drafts before the row as output
            counts = counts.clone()
            counts[draft] += 1
        rows.append(DraftRow(state.params, state.num_output_tokens + j + 1,
                             state.prompt_mask, counts, state.has_penalties,
                             None if masks is None else masks[j]))
    return rows


def _draft_masks(grammar, drafts: list[int]) -> list[DraftMask | None]:
    if grammar.failed:  # row 0 allows only EOS (apply_masks): no later row commits
        return [None] * len(drafts)
    masks, consumed = [], 0
    for draft in drafts:
        consumed += grammar.consume_draft(draft)
        row = np.zeros(grammar.words, dtype=np.int32)
        grammar.fill(row)
        masks.append(DraftMask(row))
    grammar.rollback(consumed)
    return masks


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts are accepted: the leading run equal to the row's sample."""
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a
