"""The stop rule, in one place for both services (docs/scheduling.md, "update_from_output").

The scheduler applies it to every committed token, and the worker applies it as it
samples (a request that stops sits out the rest of a multi-step decode, and a step
scheduled behind skips it). The two must agree token for token, or a step's answer
is a disagreement (docs/resilience.md), so both call the functions below and nothing
else decides a stop.

The rule, checked after each token is appended, in this order:
1. once `min_tokens` tokens are out: an EOS id (unless `ignore_eos`) or one of the
   request's `stop_token_ids` finishes it with STOP;
2. `max_tokens` output tokens, or `max_model_len` tokens in all, finish it with LENGTH.
A last allowed token that is also a stop token is reported as STOP (vLLM tests length
first and says LENGTH). Stop strings are the frontend's: it aborts on a match.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shared.types import FinishReason, SamplingParams


def stop_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The token ids that can stop a request (part 1 of the rule, min_tokens aside)."""
    stop = frozenset(params.stop_token_ids)
    return stop if params.ignore_eos else stop | frozenset(eos_token_ids)


def banned_ids(num_output_tokens: int, ids: frozenset[int], min_tokens: int) -> frozenset[int]:
    """The ids the sampler may not pick as the next output token: all of stop_ids()
    while fewer than `min_tokens` are out (vLLM's min_tokens processor), so EOS is
    banned exactly when it could stop the request: never under `ignore_eos`."""
    return ids if num_output_tokens < min_tokens else frozenset()


def is_stop(token_id: int, num_output_tokens: int, ids: frozenset[int], min_tokens: int) -> bool:
    """Does `token_id`, just appended as output token number `num_output_tokens`, stop
    the request (part 1)? `ids` is stop_ids() of the request."""
    return token_id in ids and num_output_tokens >= min_tokens


def first_stop(sampled: Sequence[int], num_output_before: int, ids: frozenset[int],
               min_tokens: int) -> int | None:
    """Index of the first token of `sampled` (appended after `num_output_before`
    output tokens) that stops the request by part 1; None if none does."""
    for j, token_id in enumerate(sampled):
        if token_id in ids and num_output_before + j + 1 >= min_tokens:
            return j
    return None


def finish_reason(token_id: int, num_output_tokens: int, num_tokens: int, ids: frozenset[int],
                  min_tokens: int, max_tokens: int, max_model_len: int) -> FinishReason | None:
    """The whole rule for the token just appended: STOP, LENGTH, or None to go on."""
    if is_stop(token_id, num_output_tokens, ids, min_tokens):
        return FinishReason.STOP
    if num_output_tokens >= max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
