"""Plain types that cross a service boundary: what the scheduler tells the workers
each step, what the workers answer, what the scheduler streams to a frontend.

Each mirrors a protobuf message in protos/ field by field, under the same names:
shared/wire/ derives the mapping from the descriptors, so a new field here needs
its line in the .proto and nothing in between (tests/wire/test_proto_parity.py).
The wire rule lives here too: a request's full data (prompt ids, sampling
parameters) travels once in NewRequestData; afterwards a step carries only
increments in CachedRequestData (new block ids, computed counts, resumed flags).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from shared.structured.spec import KINDS, StructuredOutputSpec


class FinishReason(enum.IntEnum):
    """Why a request stopped. STOP covers EOS, a stop token id and a stop string."""

    STOP = 1
    LENGTH = 2  # max_tokens or max_model_len reached
    ABORT = 3  # the client went away, or the frontend matched a stop string


class InvalidRequestError(ValueError):
    """Bad input from a client; becomes INVALID_ARGUMENT / HTTP 400 at the edge."""


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters.

    Defaults follow the OpenAI API and the reference system (vLLM).
    `top_k == 0` disables top-k; `top_p == 1.0` and `min_p == 0.0` disable theirs;
    `temperature == 0.0` is greedy. `logprobs` is the number of top alternatives
    returned beside each sampled token's own logprob (None = no logprobs).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI's: token id -> bias
    # The prompt's last n tokens are this request's own earlier output (a continuation
    # after a scheduler loss): penalties count them as output, and seeded draws go on
    # from output position n, so the continuation samples what the original would.
    num_output_prefix_tokens: int = 0
    # The output must match this grammar (shared/structured/): the worker's
    # rank 0 masks each step's logits with the request's matcher (docs/structured_outputs.md).
    structured_output: StructuredOutputSpec | None = None

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0  # OpenAI's range is [-100, 100]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field; changes nothing."""

        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(f"{name} must be a finite number")
        if self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 and self.top_k != -1:
            bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            bad(f"top_k must be at most the vocabulary size {vocab_size}, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            bad(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.num_output_prefix_tokens < 0:
            bad("num_output_prefix_tokens must be non-negative, "
                f"got {self.num_output_prefix_tokens}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            bad("seed must fit in a signed 64-bit integer")  # int64 on the wire
        spec = self.structured_output
        if spec is not None and spec.kind not in KINDS:
            bad(f"structured_output kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
        if spec is not None and (self.ignore_eos or self.min_tokens):
            # the grammar ends a request with EOS; these would forbid it where it must end
            bad("structured_output cannot be combined with ignore_eos or min_tokens")
        for tid in self.stop_token_ids:
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                bad(f"stop_token_ids contains {tid}, outside the vocabulary")
        for tid, bias in self.logit_bias.items():
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                bad(f"logit_bias has token id {tid}, outside the vocabulary")
            if not (math.isfinite(bias) and abs(bias) <= self.MAX_LOGIT_BIAS):
                bad(f"logit_bias values must be in [-100, 100], got {bias} for token {tid}")


# ---------------------------------------------------------------------------
# scheduler -> workers, once per step


@dataclass(slots=True)
class NewRequestData:
    """A request the workers have not seen: its full data, sent exactly once."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: KV already in these blocks
    # W3C trace context of the request's scheduler span, so worker spans join its trace
    trace_context: dict[str, str] = field(default_factory=dict)
    # tokens generated before these workers saw it (resent after a worker was lost):
    # the worker's token ids are prompt + these, and it samples after them
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """Requests the workers already hold, column-wise: entry i of each list is
    request req_ids[i]. `new_block_ids[i]` is appended to the block table, or,
    when `resumed_from_preemption[i]`, replaces it (the worker kept the request's
    token ids across the preemption; only its blocks were lost)."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # resumed request -> (number of token ids, token_checksum of them) the scheduler holds
    resumed_token_checks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def append(self, req_id: str, resumed: bool, new_block_ids: list[int],
               num_computed_tokens: int, token_check: tuple[int, int] | None = None) -> None:
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)
        if token_check is not None:
            self.resumed_token_checks[req_id] = token_check

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step. For every scheduled request, the worker computes the tokens at
    positions [num_computed_tokens, num_computed_tokens + num_scheduled_tokens)
    where num_computed_tokens is the value sent here (before this step). When that
    range reaches the end of the request's known tokens, the step samples one token.

    Workers first drop `finished_req_ids` entirely and drop the block tables of
    `preempted_req_ids` (keeping their token ids), then run the step."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # W3C trace context of the scheduler's step span, so worker step spans nest under it
    trace_context: dict[str, str] = field(default_factory=dict)
    # Multi-step decode: each request is scheduled for one token and the worker runs
    # num_steps forward passes in a row, feeding each sampled token into the next pass,
    # so it samples num_steps tokens per request (docs/scheduling.md).
    num_steps: int = 1
    # req_id -> grammar to compile in the background for a deferred request (rank 0
    # answers in ModelRunnerOutput.grammars_ready; docs/structured_outputs.md)
    grammar_compiles: dict[str, StructuredOutputSpec] = field(default_factory=dict)
    # Speculative decoding: req_id -> draft slots d (absent: none). Such a request's
    # num_scheduled_tokens is 1 + d: its last token and d positions the worker fills
    # with its own drafts; it answers with 1 + accepted tokens (docs/spec_decode.md).
    # Under async scheduling the sent num_computed_tokens may count the step before
    # as if all its slots were accepted; the worker runs from its own count.
    num_draft_slots: dict[str, int] = field(default_factory=dict)
    # After a failed step: the worker drops every request it holds first (the
    # scheduler resends them whole; docs/resilience.md)
    reset_requests: bool = False


# The most forward passes one multi-step decode may run: it holds new arrivals back for
# all of them (the scheduler's --num-scheduler-steps is bounded by it; workers check it).
MAX_NUM_STEPS = 64


# ---------------------------------------------------------------------------
# workers -> scheduler, once per step


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of one sampled token plus the top-n alternatives (id, logprob)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class StepTimings:
    """The worker's own clock for one step, in milliseconds."""

    prepare_ms: float = 0.0  # host-side input preparation
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    idle_ms: float = 0.0  # waiting for this step since the previous one finished
    start_unix_s: float = 0.0
    end_unix_s: float = 0.0
    num_forward_passes: int = 0  # what ran: a multi-step may end early, skipping stopped requests
    num_tokens: int = 0  # tokens computed over all passes
    mask_ms: float = 0.0  # structured outputs: grammar masks filled and applied
    draft_ms: float = 0.0  # speculative decoding: proposing drafts (n-gram, draft passes)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens of one step: `sampled_token_ids[i]` belongs to `req_ids[i]`
    and is empty for a request whose prefill chunk was not its last."""

    step_id: int
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    timings: StepTimings = field(default_factory=StepTimings)
    # announced grammars compiled since the last answer, and those that failed (id -> why)
    grammars_ready: list[str] = field(default_factory=list)
    grammar_errors: dict[str, str] = field(default_factory=dict)
    # speculative decoding: drafts proposed into each request's slots (aligned with
    # req_ids; empty when no request had slots)
    num_draft_tokens: list[int] = field(default_factory=list)
    # the step failed: the exception in one line (nothing else is set); step_skipped:
    # not run at all, an earlier step failed (docs/resilience.md)
    error: str = ""
    step_skipped: bool = False


# ---------------------------------------------------------------------------
# scheduler -> frontend, per request


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request since the last output, and its end if it ended."""

    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the EOS or stop token id that ended it
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # on the output with the first token only (scheduler_svc/metrics.py stamps them)
    queue_time_s: float | None = None
    prefill_time_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class ModelInfo:
    """What a worker reports at the handshake, and the frontend serves."""

    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int = 0  # the budget the worker profiled its memory with
    compute_plan: str = ""  # how the worker computes steps (worker_svc/compute_plan.py)
    speculative_config: str = ""  # the worker's --speculative-config, canonical JSON
    model_path: str = ""  # the worker's resolved model directory (tokenizer files, config)
    # every attention layer's sliding window, 0 if some layer sees every key: the
    # scheduler frees blocks wholly behind a running request's window (shared/kv_window.py)
    sliding_window: int = 0
    # longrope: a prompt longer than this rotates every token with the long factors,
    # so the prefix-cache hash keeps such prompts apart (0: not such a model)
    long_prompt_rope_from: int = 0
