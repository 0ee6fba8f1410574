"""Scheduler configuration and its start-up validation (rules in docs/scheduling.md)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from shared.speculative_config import SpeculativeConfig
from shared.types import MAX_NUM_STEPS

POLICIES = ("fcfs", "priority")
MAX_SCHEDULER_STEPS = MAX_NUM_STEPS  # a multi-step decode's passes (shared/types.py)


class ConfigError(ValueError):
    """A configuration that cannot work; raised at start-up with the reason."""


@dataclass(slots=True)
class SchedulerConfig:
    # Defaults follow the reference: 2,048-token budget (no GPU of 70 GiB or more here).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    block_size: int = 16
    long_prefill_token_threshold: int = 0  # 0 = off
    # docs/scheduling.md, "Limits of one step": the threshold does not apply while only
    # one request is eligible.
    # False = vLLM's rule: it always applies (docs/scheduling.md, deviations).
    long_prefill_exempt_lone_request: bool = True
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Two steps in flight (docs/scheduling.md, "Async scheduling"); on, as --async-scheduling.
    async_scheduling: bool = True
    # Multi-step decode (vLLM V0's --num-scheduler-steps): while every running request
    # is decoding and none waits, one step runs up to this many forward passes, so the
    # per-message cost of the gRPC links is paid once per that many tokens
    # (docs/scheduling.md). 1 = off.
    num_scheduler_steps: int = 1
    # Speculative decoding (vLLM's --speculative-config, parsed by
    # shared/speculative_config.py): decoding requests get up to k draft slots a step,
    # which the worker fills with its own proposals (docs/spec_decode.md). None = off.
    speculative_config: SpeculativeConfig | None = None
    # Every attention layer's sliding window, from the worker's handshake (0: some layer
    # sees every key). Blocks wholly behind a running request's window are freed as it
    # advances (docs/scheduling.md, "Sliding-window models").
    sliding_window: int = 0
    # longrope (the worker's handshake): a prompt longer than this rotates every token
    # with the long factors, so its blocks hash apart from a shorter prompt's (0: none)
    long_prompt_rope_from: int = 0
    # Per-deployment salt of the prefix-cache hash chain; random unless pinned.
    hash_seed: str = field(default_factory=lambda: secrets.token_hex(16))

    def validate(self) -> None:
        """Raise ConfigError naming the first broken rule; changes nothing."""

        def bad(msg: str) -> None:
            raise ConfigError(msg)

        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len < 2:
            bad(f"max_model_len must be at least 2 (one prompt token and one output token), "
                f"got {self.max_model_len}")
        if self.policy not in POLICIES:
            bad(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            bad(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so that every running request can "
                f"decode in one step")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            bad(f"with chunked prefill disabled, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len}), or the longest prompt could never be scheduled; "
                f"raise the budget, lower max_model_len, or enable chunked prefill")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            bad(f"long_prefill_token_threshold must be a non-negative integer (0 = off), "
                f"got {self.long_prefill_token_threshold!r}")
        if self.long_prefill_token_threshold > 0 and not self.enable_chunked_prefill:
            bad("long_prefill_token_threshold splits prompts into chunks, so it needs "
                "chunked prefill enabled")
        steps = self.num_scheduler_steps
        if not isinstance(steps, int) or isinstance(steps, bool) \
                or not 1 <= steps <= MAX_SCHEDULER_STEPS:
            bad(f"num_scheduler_steps must be an integer in [1, {MAX_SCHEDULER_STEPS}], "
                f"got {steps!r}")
        if not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) \
                or self.sliding_window < 0:
            bad(f"sliding_window must be a non-negative integer (0 = none), "
                f"got {self.sliding_window!r}")
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            bad(f"speculative_config must be a SpeculativeConfig "
                f"(shared/speculative_config.py), got {type(spec).__name__}")
        if not isinstance(self.hash_seed, str) or not self.hash_seed:
            bad("hash_seed must be a non-empty string")
