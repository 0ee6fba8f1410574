"""One choice of one request: the single owner of its state inside the frontend.

The engine client records what the scheduler produced (every token, for a
continuation after a scheduler loss: engine/continuation.py), the output stream
records how much of it the client was given and why it ended (stop strings,
request/output_stream.py, which itself keeps only the text), and the metrics
tracker reads counts and timings from here (telemetry/metrics.py). Nothing else
keeps a copy of the prompt, the parameters, the tokens or the timings.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from shared.types import FinishReason, RequestOutput, SamplingParams, TokenLogprobs

from frontend_svc.request.translate import GenerationInput


@dataclass(slots=True)
class Choice:
    req_id: str  # the client's id; the scheduler knows it by wire_id
    inp: GenerationInput
    params: SamplingParams  # one per choice: seeds differ under fan-out
    incoming: Any = None  # HTTP headers or gRPC metadata: may carry a traceparent
    operation: str = "text_completion"
    # ---- set when the engine client sends it
    trace_context: dict[str, str] = field(default_factory=dict)
    cache_salt: str | None = None  # scoped to the caller's key (api/auth.py)
    queue: asyncio.Queue | None = None  # its outputs (or an EngineError) arrive here
    wire_id: str = ""  # the id the current scheduler knows it by
    num_resumes: int = 0
    # ---- what the scheduler produced, as it arrives (all of it: a continuation resends it)
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0  # of the client's prompt, as the first scheduler said
    num_outputs: int = 0  # outputs seen, of any scheduler
    num_preemptions: int = 0
    queue_time_s: float | None = None  # the first scheduler's, from the first-token output
    prefill_time_s: float | None = None
    # ---- what the client was given (a stop string may cut `generated` short)
    num_output_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    # when it was sent (start()): after tokenizing and admission, as the client's TTFT
    arrival_unix_s: float = field(default_factory=time.time)  # for the wire
    arrival_s: float = field(default_factory=time.monotonic)  # latencies: monotonic
    first_token_s: float | None = None
    last_token_s: float | None = None
    previous_token_s: float | None = None  # the delivery before the last (the ITL's start)

    def __post_init__(self) -> None:
        self.wire_id = self.wire_id or self.req_id

    @classmethod
    def for_prompt(cls, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   priority: int = 0, cache_salt: str | None = None) -> Choice:
        """A choice of a bare token prompt (no stops or constraint)."""
        return cls(req_id, GenerationInput(list(prompt_token_ids), params, priority=priority,
                                           cache_salt=cache_salt), params)

    def start(self) -> None:
        """It is being sent now: its latencies count from here."""
        self.arrival_unix_s, self.arrival_s = time.time(), time.monotonic()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.inp.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.inp.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def seen(self, out: RequestOutput) -> RequestOutput:
        """Record a scheduler output as it arrives; report it under the client's id
        and counts (a continuation's scheduler counts the resent tokens as cached)."""
        self.generated.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        if self.num_outputs == 0:
            self.num_cached_tokens = out.num_cached_tokens
        self.num_outputs += 1
        if out.queue_time_s is not None and self.queue_time_s is None:
            self.queue_time_s, self.prefill_time_s = out.queue_time_s, out.prefill_time_s
        self.num_preemptions = max(self.num_preemptions, out.num_preemptions)
        out.req_id = self.req_id
        out.num_cached_tokens = self.num_cached_tokens
        return out

    def record_tokens(self, num_new: int, now: float | None = None) -> None:
        """The client was given num_new more tokens (0: nothing changes)."""
        if num_new <= 0:
            return
        now = time.monotonic() if now is None else now
        self.previous_token_s = self.last_token_s
        self.first_token_s = self.first_token_s or now
        self.last_token_s = now
        self.num_output_tokens += num_new

    # ---- usage and timings, for the final message

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens the client was given."""
        return self.generated[:self.num_output_tokens]

    @property
    def output_logprobs(self) -> list[TokenLogprobs]:
        return self.logprobs[:self.num_output_tokens]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_output_tokens

    def timings_ms(self, now: float | None = None) -> dict[str, float]:
        now = time.monotonic() if now is None else now
        n, first, last = self.num_output_tokens, self.first_token_s, self.last_token_s
        ttft = (first - self.arrival_s) * 1e3 if first else 0.0
        itl = (last - first) * 1e3 / (n - 1) if n > 1 and first and last else 0.0
        return {"time_to_first_token_ms": ttft, "e2e_ms": (now - self.arrival_s) * 1e3,
                "mean_inter_token_ms": itl}
