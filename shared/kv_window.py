"""Sliding-window KV: which blocks a request still needs, and how many it holds at most.

A model whose every attention layer has a sliding window (Mistral v0.1) never reads a
key `window` or more positions behind the query again, so the scheduler frees the
blocks wholly behind the window of the next token to compute, while the request runs
(as vLLM's SlidingWindowManager does; docs/scheduling.md, "Sliding-window models").
Scheduler and worker both size the pool by the same bound, so it is defined here once.
"""

from __future__ import annotations


def first_needed_position(num_computed_tokens: int, window: int, lookback: int = 0) -> int:
    """The first position whose KV a request with `num_computed_tokens` computed may still
    read: the next query (at num_computed_tokens) sees window - 1 keys behind it.
    lookback: positions it may step back first (speculative drafts rolled back)."""
    return max(0, num_computed_tokens - lookback - window + 1)


def max_blocks_per_request(max_model_len: int, block_size: int, window: int = 0,
                           max_chunk: int = 0, lookback: int = 0) -> int:
    """The most blocks one request holds at once: every block of max_model_len - 1
    tokens (the last token is sampled, never computed), or, with a window (0: none) and
    chunks of at most `max_chunk` tokens, the window's blocks before a chunk plus the
    chunk's, plus one for each end that may sit inside a block."""
    full = -(-(max_model_len - 1) // block_size)
    if not window:
        return full
    return min(full, (window - 1 + lookback + max_chunk) // block_size + 2)
