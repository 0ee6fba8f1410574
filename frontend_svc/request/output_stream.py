"""One choice's text as the client sees it: token ids from the scheduler in, text
deltas out, with stop strings applied. The stream keeps only text state; the
tokens, counts, finish and timings are its Choice's (request/choice.py), which it
tells how many tokens the client was given and why the choice ended.

Usage follows the reference system (vLLM): completion tokens are the tokens the
client was given, so a stop string ends the count at the token that completed it
(later tokens of the same step are dropped), and an EOS or stop token id counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.types import FinishReason, RequestOutput, TokenLogprobs

from frontend_svc.request.choice import Choice

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
    choice: Choice
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    include_stop_str_in_output: bool = False
    text: str = ""
    num_sent_chars: int = 0
    # True when the frontend ended the request (stop string) but the scheduler has not.
    needs_abort: bool = False

    @property
    def finished(self) -> bool:
        return self.choice.finish_reason is not None

    def process(self, out: RequestOutput, now: float | None = None) -> Delta:
        """Apply one scheduler output; returns the delta for the client."""
        choice = self.choice
        if self.finished:
            return Delta([], "", [])
        new_ids: list[int] = []
        new_logprobs: list[TokenLogprobs] = []
        for i, token_id in enumerate(out.new_token_ids):
            new_ids.append(token_id)
            if i < len(out.new_logprobs):
                new_logprobs.append(out.new_logprobs[i])
            if self._add_text(self.detokenizer.step(token_id),
                              choice.num_output_tokens + len(new_ids)):
                self.needs_abort = not out.finished
                break
        choice.record_tokens(len(new_ids), now)
        if not self.finished and out.finished:
            self._add_text(self.detokenizer.flush(), choice.num_output_tokens)
        if not self.finished and out.finished:
            choice.finish_reason = out.finish_reason
            if out.stop_token_id is not None and out.stop_token_id in choice.params.stop_token_ids:
                choice.stop_reason = out.stop_token_id
        end = len(self.text) if self.finished else len(self.text) - self.stops.holdback(self.text)
        text = self.text[self.num_sent_chars:end] if end > self.num_sent_chars else ""
        self.num_sent_chars = max(self.num_sent_chars, end)
        return Delta(new_ids, text, new_logprobs, choice.finish_reason, choice.stop_reason)

    def _add_text(self, piece: str, num_output_tokens: int) -> bool:
        """Append decoded text (of the first num_output_tokens output tokens); True
        when it completed a stop string."""
        if not piece:
            return False
        self.text += piece
        if num_output_tokens <= self.choice.params.min_tokens:
            return False  # the reference checks stop strings only after min_tokens
        match = self.stops.find(self.text, len(piece))
        if match is None:
            return False
        keep = len(match.stop) if self.include_stop_str_in_output else 0
        self.text = self.text[:match.index + keep]
        self.choice.finish_reason = FinishReason.STOP
        self.choice.stop_reason = match.stop
        return True
