"""The limits a request's token ids must keep, stated once (docs/scheduling.md, "Limits
of one step").

Validation runs at two doors: the frontend's, with OpenAI-style errors
(frontend_svc/request/translate.py), and the scheduler's for any gRPC client
(Engine.check in scheduler_svc/engine.py). Behind them the scheduler's core
(core/scheduler.py) asserts the O(1) part, and the worker (step_check.py) refuses a
step that breaks them before any compute, with this one function, so the services
cannot drift apart on what a valid request is.
"""

from __future__ import annotations

from collections.abc import Sequence


def token_ids_problem(token_ids: Sequence[int], max_model_len: int, vocab_size: int | None = None,
                      max_tokens: int | None = None, what: str = "the prompt") -> str | None:
    """What is wrong with a request of these token ids, as one sentence; None if nothing.

    - at least one token;
    - fewer than max_model_len: a request must have room for one output token (one
      that reaches max_model_len has finished, so a resent one also has fewer);
    - each id in [0, vocab_size), when the vocabulary is known;
    - with `max_tokens`, tokens + max_tokens within max_model_len.
    """
    n = len(token_ids)
    if not n:
        return f"{what} is empty: it must contain at least one token"
    if n >= max_model_len:
        return (f"{what} has {n} tokens; max_model_len is {max_model_len}, which must hold "
                f"them and at least one output token, so it leaves no room for an output token")
    if vocab_size is not None:
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            return f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size})"
    if max_tokens is not None and n + max_tokens > max_model_len:
        return (f"{what} ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} "
                f"exceeds max_model_len ({max_model_len})")
    return None
