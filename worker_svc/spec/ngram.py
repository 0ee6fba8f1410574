"""Prompt lookup (n-gram) proposals: the drafts are the tokens that followed an earlier
occurrence of the context's suffix (docs/spec_decode.md).

vLLM's semantics (v1/spec_decode/ngram_proposer.py): find the longest n in
[prompt_lookup_min, prompt_lookup_max] such that the last n tokens occurred earlier
in the context (an occurrence may overlap the suffix, but must end before the
context does, so that at least one token follows it); propose the up to k tokens
that followed it, never past the end of the context nor past max_model_len. Among
occurrences of that length vLLM takes the earliest (its reversed KMP scan keeps the
last position it meets); `prefer="latest"` takes the most recent one instead.

The scan works on candidate end positions: first every position that follows a copy
of the last token (one vectorised comparison over the context), then, for n = 2, 3,
... only the survivors are compared one token further back. The work is one pass
over the context plus a pass per n over a set that shrinks fast; no Python loop runs
over the context. Timings: `python benchmarks/ngram_proposer.py`.
"""

from __future__ import annotations

import numpy as np

NO_DRAFTS = np.empty(0, dtype=np.int64)


def propose(tokens: np.ndarray, k: int, min_n: int, max_n: int,
            max_model_len: int | None = None, prefer: str = "earliest") -> np.ndarray:
    """Up to k draft tokens for a context (1-D integer array: prompt + output).
    Returns a view into `tokens` (possibly empty)."""
    total = tokens.shape[0]
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if k <= 0 or total < max(min_n, 2):
        return NO_DRAFTS
    ends = _longest_match_ends(tokens, min_n, max_n)
    if ends is None:
        return NO_DRAFTS
    end = int(ends[0] if prefer == "earliest" else ends[-1])
    return tokens[end:end + k]


def _longest_match_ends(tokens: np.ndarray, min_n: int, max_n: int) -> np.ndarray | None:
    """Ascending end positions e (exclusive, e < len) of the earlier occurrences of the
    longest suffix of length n <= max_n; None if that n is below min_n."""
    total = tokens.shape[0]
    # e such that tokens[e - 1] == tokens[-1], for e in [1, total - 1]
    ends = np.flatnonzero(tokens[:total - 1] == tokens[total - 1]) + 1
    if ends.size == 0:
        return None
    found, n = ends, 1
    while n < max_n:
        ends = ends[ends > n]  # room for one more token before the occurrence's start
        if ends.size == 0:
            break
        ends = ends[tokens[ends - n - 1] == tokens[total - n - 1]]
        if ends.size == 0:
            break
        found, n = ends, n + 1
    return found if n >= min_n else None


def propose_batch(contexts: list[np.ndarray], slots: list[int], min_n: int, max_n: int,
                  max_model_len: int | None = None) -> list[np.ndarray]:
    """One proposal per request, at most its number of draft slots each."""
    return [propose(c, k, min_n, max_n, max_model_len) if k else NO_DRAFTS
            for c, k in zip(contexts, slots)]
