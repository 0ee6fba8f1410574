"""What the worker remembers per request between steps, so a step carries only
increments: its tokens (prompt + everything it sampled), block table, computed
count, and sampling state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.types import SamplingParams


@dataclass(slots=True)
class RequestState:
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
        the scheduler's rule (SCHEDULING.md): once min_tokens are out, an EOS id
        (unless ignore_eos) or one of its stop_token_ids. Length limits need no
        check here: the scheduler schedules no token past them."""
        self.token_ids.append(token_id)
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        p = self.params
        if (token_id in p.stop_token_ids or (token_id in eos_token_ids and not p.ignore_eos)) \
                and self.num_output_tokens >= p.min_tokens:
            self.stopped = True
