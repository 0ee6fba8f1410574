"""Bounds on what one request may ask of the frontend (--max-client-batch-size,
--max-choices-per-request, --max-stop-sequences, ...), checked before anything is
tokenized or queued so a small hostile body cannot fan out into thousands of
requests, quadratic stop matching or a huge tokenization. Defaults = the flags'."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prometheus_client import Counter

from shared.config import FrontendFlags
from shared.flag_spec import from_flags
from shared.types import InvalidRequestError

REJECTED = Counter("gapserve:frontend_rejected_requests",
                   "Requests the frontend refused before queueing, by reason.", ["reason"])
# A normalizer (NFKC, lowercasing, ...) may shrink text before it is split into
# tokens, so the bound from the longest token gets this margin.
NORMALIZER_MARGIN = 4


def refuse(reason: str, message: str) -> InvalidRequestError:
    REJECTED.labels(reason).inc()
    return InvalidRequestError(message)


def too_many_choices(count: int, limit: int, flags: str) -> InvalidRequestError:
    """The one wording of every bound on choices (a choice is a request at the scheduler)."""
    return refuse("choices", f"this request asks for {count} choices (prompts x n, or x "
                             f"best_of); at most {limit} are allowed ({flags})")


@dataclass(frozen=True, slots=True)
class RequestCaps:
    max_client_batch_size: int = 128
    max_choices_per_request: int = 256
    max_stop_sequences: int = 16
    max_stop_sequence_length: int = 256
    max_stop_token_ids: int = 256
    max_prompt_bytes: int | None = None  # None: no bound (set from the model at start-up)

    @classmethod
    def from_args(cls, args) -> "RequestCaps":
        """Each field is the flag of its name (shared/config.py AdmissionFlags)."""
        return from_flags(cls, args, FrontendFlags)

    def for_model(self, max_model_len: int, max_token_bytes: int) -> "RequestCaps":
        """These caps with the default prompt-byte bound filled in: no text longer
        than max_model_len of the model's longest tokens can fit the context."""
        if self.max_prompt_bytes is not None:
            return self
        return dataclasses.replace(
            self, max_prompt_bytes=max_model_len * max_token_bytes * NORMALIZER_MARGIN)

    def check_batch(self, num_prompts: int, n: int) -> None:
        if num_prompts > self.max_client_batch_size:
            raise refuse("batch", f"at most {self.max_client_batch_size} prompts per request "
                                  f"(--max-client-batch-size), got {num_prompts}")
        if num_prompts * n > self.max_choices_per_request:
            raise too_many_choices(num_prompts * n, self.max_choices_per_request,
                                   "--max-choices-per-request")

    def check_stops(self, stops: list[str], stop_token_ids: list[int] | None) -> None:
        if len(stops) > self.max_stop_sequences:
            raise refuse("stop", f"at most {self.max_stop_sequences} stop strings "
                                 f"(--max-stop-sequences), got {len(stops)}")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_sequence_length:
            raise refuse("stop", f"stop strings may be at most "
                                 f"{self.max_stop_sequence_length} characters "
                                 f"(--max-stop-sequence-length), got {longest}")
        count = len(stop_token_ids or ())
        if count > self.max_stop_token_ids:
            raise refuse("stop_token_ids", f"at most {self.max_stop_token_ids} stop_token_ids "
                                           f"(--max-stop-token-ids), got {count}")

    def check_body_for_text(self, body_bytes: int) -> None:
        """Before parsing a body that is mostly text: a JSON escape (\\u0041) takes at
        most 6 bytes per byte of text, so a larger body cannot hold a prompt within
        the bound, and is refused without holding the GIL to parse it."""
        if self.max_prompt_bytes is not None and \
                body_bytes > 6 * self.max_prompt_bytes + (64 << 10):
            raise refuse("prompt_bytes", f"the request body is {body_bytes} bytes; a prompt "
                                         f"of at most {self.max_prompt_bytes} bytes is "
                                         "accepted (--max-prompt-bytes)")

    @staticmethod
    def check_token_ids(count: int, max_model_len: int) -> None:
        """No sequence of this model is longer than its context."""
        if count > max_model_len:
            raise refuse("token_ids", f"at most {max_model_len} token ids (the model's "
                                      f"context) are accepted, got {count}")

    def check_text(self, text: str, what: str = "the prompt") -> None:
        """Before tokenizing: text longer than any prompt of max_model_len tokens
        could be is refused without spending the tokenizer's time on it."""
        if self.max_prompt_bytes is None or len(text) * 4 <= self.max_prompt_bytes:
            return  # at most 4 UTF-8 bytes per character: no need to encode
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            raise refuse("prompt_bytes", f"{what} is {size} bytes; at most "
                                         f"{self.max_prompt_bytes} are accepted "
                                         "(--max-prompt-bytes)")
