"""The search the "call cut by max_tokens" tests make (test_agent_clients.py,
test_responses_api.py): the largest max_tokens a little below a greedy tool-call
reply's length whose stream ends inside a call's arguments (its last chunk names
`cut_tool_calls`), not between calls.

Greedy: every max_tokens gives a prefix of the same reply, so the candidates are
streamed at once (batched greedy equals greedy alone:
test_openai_api.py::test_32_concurrent_greedy_requests_equal_transformers) and the
largest that cuts is taken, the one the one-by-one search from the top found. One at a
time they cost ~2.6 s each on the default model (five before the cut, 13 s); five at
once about as much as two."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

WAVE = 5


def cut_by_max_tokens(stream, n: int):
    """stream(max_tokens) -> the stream's chunks that have choices; n: the uncut reply's
    completion tokens. Returns (max_tokens, its chunks), or None if none cut a call."""
    candidates = list(range(n - 2, max(n - 12, 3), -1))
    for wave in (candidates[:WAVE], candidates[WAVE:]):  # from the top, WAVE at once
        with ThreadPoolExecutor(WAVE) as pool:
            runs = list(pool.map(stream, wave))
        for max_tokens, chunks in zip(wave, runs):
            if (chunks[-1].choices[0].model_extra or {}).get("cut_tool_calls"):
                return max_tokens, chunks
    return None
