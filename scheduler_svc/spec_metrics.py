"""Speculative decoding's telemetry on the scheduler's port (docs/spec_decode.md,
docs/observability.md): vLLM's spec_decode_* counters under gapserve's prefix (the
frontend's /metrics serves them as vllm:spec_decode_*, from EngineStatus), the time
the workers spent proposing, and the attributes a step's span gets.

    acceptance rate = num_accepted_tokens / num_draft_tokens
    mean accepted length = 1 + num_accepted_tokens / num_drafts  (tokens a draft step commits)
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram

from shared.types import ModelRunnerOutput

_M = ["model_name"]
NUM_DRAFTS = Counter("gapserve:spec_decode_num_drafts",
                     "Request-steps whose worker proposed drafts (vLLM's num_drafts).", _M)
NUM_DRAFT_TOKENS = Counter("gapserve:spec_decode_num_draft_tokens",
                           "Draft tokens proposed (vLLM's num_draft_tokens).", _M)
NUM_ACCEPTED_TOKENS = Counter("gapserve:spec_decode_num_accepted_tokens",
                              "Draft tokens the target accepted.", _M)
NUM_ACCEPTED_PER_POS = Counter("gapserve:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted drafts by position in their step (0: the first).",
                               _M + ["position"])
DRAFT_TIME = Histogram("gapserve:spec_decode_draft_seconds",
                       "Time a worker step spent proposing drafts (prompt lookup, or the "
                       "draft model's passes), beside its verify pass.", _M,
                       buckets=[0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                0.1, 0.25, 0.5, 1.0])


class SpecTelemetry:
    """Counts from the scheduler's cumulative stats (an increment is the difference,
    as for the prefix cache), per model."""

    def __init__(self, model_name: str, k: int) -> None:
        self.model_name = model_name
        self._drafts = NUM_DRAFTS.labels(model_name)
        self._draft_tokens = NUM_DRAFT_TOKENS.labels(model_name)
        self._accepted = NUM_ACCEPTED_TOKENS.labels(model_name)
        self._per_pos = [NUM_ACCEPTED_PER_POS.labels(model_name, str(i)) for i in range(k)]
        self._draft_time = DRAFT_TIME.labels(model_name)
        self._seen = (0, 0, 0, (0,) * k)

    def observe(self, stats: Any) -> None:
        drafts, tokens = stats.spec_num_drafts, stats.spec_num_draft_tokens
        accepted, per_pos = stats.spec_num_accepted_tokens, stats.spec_num_accepted_tokens_per_pos
        s_drafts, s_tokens, s_accepted, s_pos = self._seen
        for counter, now, before in ((self._drafts, drafts, s_drafts),
                                     (self._draft_tokens, tokens, s_tokens),
                                     (self._accepted, accepted, s_accepted)):
            if now > before:
                counter.inc(now - before)
        for counter, now, before in zip(self._per_pos, per_pos, s_pos):
            if now > before:
                counter.inc(now - before)
        self._seen = (max(drafts, s_drafts), max(tokens, s_tokens),
                      max(accepted, s_accepted), tuple(map(max, per_pos, s_pos)))

    def step_finished(self, result: ModelRunnerOutput) -> dict[str, float | int]:
        """The draft time's histogram, and the step span's attributes: drafts proposed
        and accepted in this step (accepted: each request's tokens past the first)."""
        if not result.num_draft_tokens:
            return {}
        self._draft_time.observe(result.timings.draft_ms / 1e3)
        accepted = sum(len(ids) - 1 for ids, n in zip(result.sampled_token_ids,
                                                       result.num_draft_tokens) if n and ids)
        return {"gapserve.worker.draft_ms": result.timings.draft_ms,
                "gapserve.step.num_draft_tokens": sum(result.num_draft_tokens),
                "gapserve.step.num_accepted_tokens": accepted}
