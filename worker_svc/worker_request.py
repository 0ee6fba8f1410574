"""What the worker remembers per request between steps, so a step carries only
increments: its tokens (prompt + everything it sampled), block table, computed
count, and sampling state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared import stop_rule
from shared.types import SamplingParams
from worker_svc.grammar import GrammarState


@dataclass(slots=True)
class WorkerRequest:
    req_id: str
    token_ids: list[int]  # prompt followed by every token this worker sampled
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    row: int  # this request's row in the runner's on-device last-sampled-token tensor
    prompt_mask: torch.Tensor | None = None  # [vocab] bool, for the repetition penalty
    output_counts: torch.Tensor | None = None  # [vocab] int, frequency/presence penalties
    # Sampled a stop token: the scheduler finishes the request on it, so a step it
    # had already scheduled behind (async scheduling) skips the request here.
    stopped: bool = False
    stop_ids: frozenset[int] | None = None  # of the stop rule, built on the first token
    # Structured outputs, on the rank that samples: the matcher after the tokens so far
    # (worker_svc/grammar.py); it masks every sampled position, every pass.
    grammar: GrammarState | None = None
    # Speculative decoding (worker_svc/spec/): (step id, draft slots rejected there) of
    # its last step with slots, which the next step's sent count may still include
    # (step_check.own_computed); and the proposer's own per-request state.
    last_rejection: tuple[int, int] | None = None
    draft_state: object = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0)

    def record_sampled(self, token_id: int, eos_token_ids: frozenset[int]) -> None:
        """Append a sampled token; mark the request stopped if the token stops it by
        the scheduler's rule (shared/stop_rule.py, so the two cannot disagree). Length
        limits need no check here: the scheduler schedules no token past them."""
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.advance(token_id)
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        if self.stop_ids is None:
            self.stop_ids = stop_rule.stop_ids(self.params, eos_token_ids)
        if stop_rule.is_stop(token_id, self.num_output_tokens, self.stop_ids,
                             self.params.min_tokens):
            self.stopped = True
