"""What the scheduler reports for telemetry; the services turn it into metrics."""

from __future__ import annotations

from dataclasses import dataclass

# Why the head of WAITING was not admitted in the last step (None: nothing waited).
BLOCKED_BY = ("max_num_seqs", "token_budget", "kv_cache", "preemption")


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_preempted: int = 0  # of num_waiting: preempted, to be recomputed
    # of num_waiting: deferred (not ready): a grammar compiling (core/grammar_wait.py)
    num_waiting_not_ready: int = 0
    admission_blocked_by: str | None = None  # one of BLOCKED_BY
    kv_usage: float = 0.0  # 1 - free / (total - 1)
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions_total: int = 0
    # blocks freed behind a sliding window while their request ran, cumulative
    num_window_freed_blocks_total: int = 0
    num_recomputed_tokens_total: int = 0  # computed before a preemption, computed again after it
    step_num_scheduled_tokens: int = 0  # last step
    step_num_scheduled_reqs: int = 0  # last step
    step_num_preempted: int = 0  # last step
    num_steps: int = 0
    num_steps_in_flight: int = 0
    # Speculative decoding (docs/spec_decode.md), cumulative, vLLM's spec_decode_* set:
    # slots are what the scheduler reserved; the worker proposes at most that many
    # drafts (an n-gram without a match: fewer), and the acceptance rate is vLLM's,
    # accepted drafts per proposed draft.
    step_num_draft_slots: int = 0  # last step
    spec_num_drafts: int = 0  # request-steps whose worker proposed drafts (vLLM's num_drafts)
    spec_num_draft_tokens: int = 0  # drafts proposed (vLLM's num_draft_tokens)
    spec_num_draft_slots: int = 0  # slots of the request-steps that committed
    spec_num_accepted_tokens: int = 0  # drafts the worker accepted
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: accepted at draft i

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts per proposed draft, vLLM's (0 without speculation)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens \
            if self.spec_num_draft_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
