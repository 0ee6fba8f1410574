"""One request as the scheduler sees it: token ids, counters and status."""

from __future__ import annotations

import enum
from collections.abc import Callable

from shared.stop_rule import stop_ids
from shared.types import FinishReason, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3  # back in WAITING, to be recomputed
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # it broke the workers' steps (core/step_failure.py): an error


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """State of one request. `num_computed_tokens` advances when work is scheduled;
    `num_output_placeholders` counts tokens that in-flight steps will sample and whose
    ids are not known yet (async scheduling, or a multi-step decode's later passes)."""

    __slots__ = (
        "req_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time",
        "priority", "cache_salt", "output_token_ids", "all_token_ids", "num_prompt_tokens",
        "num_computed_tokens", "num_output_placeholders", "status", "stop_token_id",
        "num_preemptions", "num_cached_tokens", "block_hashes", "block_hasher",
        "max_tokens", "min_tokens", "next_hash_at",
        "num_lost_tokens", "stop_check_ids", "max_num_tokens", "worker_forgot",
        "num_rejected_tokens",
        "deferred", "num_strikes", "num_failed_steps", "num_output_at_failure", "fail_at",
    )

    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: list[int] | tuple[int, ...] = (), arrival_time: float = 0.0,
                 priority: int = 0, cache_salt: str | None = None) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.status = RequestStatus.WAITING
        self.stop_token_id: int | None = None
        self.num_preemptions = 0
        self.num_lost_tokens = 0  # computed tokens dropped by the last preemption
        # Draft slots taken back so far (speculative decoding): a step in flight scheduled
        # before a rollback counts its positions as if those drafts had been accepted.
        self.num_rejected_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        # The workers lost their state (one was replaced): resend it whole, as new.
        self.worker_forgot = False
        # Not ready: its grammar is compiling (core/grammar_wait.py); WAITING skips it
        # and it keeps its place there.
        self.deferred = False
        # Failed steps it was in (core/step_failure.py; a worker loss counts as one):
        # strikes since it last got past fail_at (its computed tokens the failure would
        # have reached), and failed steps since its output had num_output_at_failure
        # tokens (a new token restarts that count).
        self.num_strikes = 0
        self.num_failed_steps = 0
        self.num_output_at_failure = 0
        self.fail_at = 0
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of committed tokens
        self.block_hasher: Callable[[Request], None] | None = None
        self.next_hash_at = 1 << 62  # token count at which the next block fills (set by the hasher)
        # Copied out of sampling_params: read on every step's hot path.
        self.max_tokens = sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        # A sampled token needs the full stop check only if it is in here or the
        # request reaches max_num_tokens (the scheduler lowers it to max_model_len).
        self.stop_check_ids = stop_ids(sampling_params, self.eos_token_ids)
        self.max_num_tokens = self.num_prompt_tokens + self.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def gap(self) -> int:
        """Tokens this request still needs scheduled: the gap of docs/scheduling.md."""
        return len(self.all_token_ids) + self.num_output_placeholders - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        """Commit one sampled token; only committed tokens are hashed into the prefix cache."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) >= self.next_hash_at:
            self.block_hasher(self)

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, placeholders={self.num_output_placeholders})")
