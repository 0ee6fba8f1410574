"""One request's output as the frontend sees it: token ids from the scheduler in,
text deltas out, with stop strings applied and usage and timings counted.

Usage follows the reference system (vLLM): completion tokens are the tokens the
client was given, so a stop string ends the count at the token that completed it
(later tokens of the same step are dropped), and an EOS or stop token id counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.types import FinishReason, RequestOutput, SamplingParams, TokenLogprobs

from frontend_svc.request.detokenizer import IncrementalDetokenizer
from frontend_svc.request.stops import StopStrings

FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                FinishReason.ABORT: "abort"}


@dataclass(slots=True)
class Delta:
    """What to send the client now. `text` may lag `token_ids` while a possible
    stop string or an incomplete character is held back."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def finish_name(self) -> str | None:
        return FINISH_NAMES[self.finish_reason] if self.finish_reason else None


@dataclass(slots=True)
class OutputStream:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    include_stop_str_in_output: bool = False
    arrival_s: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    num_sent_chars: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # True when the frontend ended the request (stop string) but the scheduler has not.
    needs_abort: bool = False
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, out: RequestOutput, now: float | None = None) -> Delta:
        """Apply one scheduler output; returns the delta for the client."""
        if self.finished:
            return Delta([], "", [])
        now = time.time() if now is None else now
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.num_preemptions = max(self.num_preemptions, out.num_preemptions)
        new_ids: list[int] = []
        new_logprobs: list[TokenLogprobs] = []
        for i, token_id in enumerate(out.new_token_ids):
            new_ids.append(token_id)
            self.output_token_ids.append(token_id)
            if i < len(out.new_logprobs):
                new_logprobs.append(out.new_logprobs[i])
                self.logprobs.append(out.new_logprobs[i])
            if self._add_text(self.detokenizer.step(token_id)):
                self.needs_abort = not out.finished
                break
        if new_ids:
            self.first_token_s = self.first_token_s or now
            self.last_token_s = now
        if not self.finished and out.finished:
            self._add_text(self.detokenizer.flush())
        if not self.finished and out.finished:
            self.finish_reason = out.finish_reason
            if out.stop_token_id is not None and out.stop_token_id in self.params.stop_token_ids:
                self.stop_reason = out.stop_token_id
        end = len(self.text) if self.finished else len(self.text) - self.stops.holdback(self.text)
        text = self.text[self.num_sent_chars:end] if end > self.num_sent_chars else ""
        self.num_sent_chars = max(self.num_sent_chars, end)
        return Delta(new_ids, text, new_logprobs, self.finish_reason, self.stop_reason)

    def _add_text(self, piece: str) -> bool:
        """Append decoded text; True when it completed a stop string."""
        if not piece:
            return False
        self.text += piece
        if len(self.output_token_ids) <= self.params.min_tokens:
            return False  # the reference checks stop strings only after min_tokens
        match = self.stops.find(self.text, len(piece))
        if match is None:
            return False
        keep = len(match.stop) if self.include_stop_str_in_output else 0
        self.text = self.text[:match.index + keep]
        self.finish_reason = FinishReason.STOP
        self.stop_reason = match.stop
        return True

    # ---- usage and timings, for the final message

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.output_token_ids)

    def timings_ms(self, now: float | None = None) -> dict[str, float]:
        now = time.time() if now is None else now
        n = len(self.output_token_ids)
        ttft = (self.first_token_s - self.arrival_s) * 1e3 if self.first_token_s else 0.0
        itl = ((self.last_token_s - self.first_token_s) * 1e3 / (n - 1)
               if n > 1 and self.first_token_s and self.last_token_s else 0.0)
        return {"time_to_first_token_ms": ttft, "e2e_ms": (now - self.arrival_s) * 1e3,
                "mean_inter_token_ms": itl}
