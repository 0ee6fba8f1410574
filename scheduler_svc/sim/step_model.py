"""How long a simulated worker step takes. The one place its default costs live.

step_ms = fixed + per_seq * (requests in the step)
                + per_prefill_token * (scheduled tokens that are not single-token decodes)
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.types import SchedulerOutput

# Fitted by benchmarks/worker_step.py on the default model, float32, 2 CPU threads
# (docs/worker.md, 2026-11-29 16:39 UTC): the machine this project is developed on.
DEFAULT_FIXED_MS = 25.3
DEFAULT_PER_SEQ_MS = 3.09
DEFAULT_PER_PREFILL_TOKEN_MS = 1.18


@dataclass(slots=True)
class StepModel:
    fixed_ms: float = DEFAULT_FIXED_MS
    per_seq_ms: float = DEFAULT_PER_SEQ_MS
    per_prefill_token_ms: float = DEFAULT_PER_PREFILL_TOKEN_MS

    def step_ms(self, so: SchedulerOutput) -> float:
        if not so.num_scheduled_tokens:
            return 0.0
        # A one-token entry is a decode (or a prefill reduced to its last token by a
        # prefix hit, which costs the same); longer entries are prefill chunks.
        prefill = sum(n for n in so.num_scheduled_tokens.values() if n > 1)
        return (self.fixed_ms + self.per_seq_ms * len(so.num_scheduled_tokens)
                + self.per_prefill_token_ms * prefill)

    def budget_for(self, target_ms: float) -> int:
        """The token budget that keeps a step under target_ms: (T - fixed) / per_prefill_token."""
        if self.per_prefill_token_ms <= 0:
            raise ValueError("per-prefill-token cost must be positive to derive a budget")
        return max(0, int((target_ms - self.fixed_ms) / self.per_prefill_token_ms))
