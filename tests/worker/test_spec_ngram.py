"""Prompt lookup proposals (worker_svc/spec/ngram.py): vLLM's semantics, case by case
and against a direct transcription of the rule over random contexts."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_svc.spec.ngram import propose, propose_batch


def arr(xs):
    return np.array(xs, dtype=np.int64)


def reference(tokens, k, min_n, max_n, prefer="earliest"):
    """The rule as written: the longest n in [min_n, max_n] whose suffix occurs earlier
    (ending before the context ends); the k tokens after that occurrence."""
    tokens = list(tokens)
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        ends = [e for e in range(n, total) if tokens[e - n:e] == tokens[total - n:]]
        if ends:
            e = ends[0] if prefer == "earliest" else ends[-1]
            return tokens[e:e + k]
    return []


def test_vllm_docstring_example():
    # [4, 2, 3] cannot be matched; [2, 3] is, and three tokens follow it
    assert propose(arr([1, 2, 3, 4, 2, 3]), 4, 2, 3).tolist() == [4, 2, 3]


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    ctx = arr([7, 8, 9, 50, 51, 5, 9, 60, 7, 8, 9])  # [7, 8, 9] at the start, [9] later
    assert propose(ctx, 2, 1, 3).tolist() == [50, 51]


def test_earliest_occurrence_by_default_most_recent_on_request():
    ctx = arr([1, 2, 30, 31, 1, 2, 40, 41, 1, 2])
    assert propose(ctx, 2, 2, 2).tolist() == [30, 31]  # vLLM's choice
    assert propose(ctx, 2, 2, 2, prefer="latest").tolist() == [40, 41]


def test_matches_may_overlap_the_suffix_but_must_end_before_it():
    assert propose(arr([1, 1, 1, 1]), 3, 1, 3).tolist() == [1]  # [1,1,1] at 0..2, then 1
    assert propose(arr([5, 5]), 3, 1, 1).tolist() == [5]


def test_no_proposal_without_a_match_of_min_n():
    assert propose(arr([1, 2, 3, 4]), 3, 1, 3).size == 0
    assert propose(arr([1, 2, 9, 2]), 3, 2, 3).size == 0  # only [2] matches
    assert propose(arr([3]), 3, 1, 3).size == 0
    assert propose(arr([1, 2]), 3, 2, 2).size == 0  # the whole context is the suffix


def test_k_and_max_model_len_bound_the_drafts():
    ctx = arr([1, 2, 3, 4, 5, 6, 1, 2])
    assert propose(ctx, 3, 2, 2).tolist() == [3, 4, 5]
    assert propose(ctx, 3, 2, 2, max_model_len=10).tolist() == [3, 4]
    assert propose(ctx, 3, 2, 2, max_model_len=8).size == 0
    assert propose(ctx, 0, 2, 2).size == 0


def test_batch_gives_each_request_at_most_its_slots():
    ctxs = [arr([1, 2, 3, 1, 2]), arr([4, 5, 6]), arr([7, 8, 7, 8, 7, 8])]
    got = propose_batch(ctxs, [5, 2, 0], 1, 3)
    assert [g.tolist() for g in got] == [[3, 1, 2], [], []]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       k=st.integers(1, 6), lo=st.integers(1, 4), extra=st.integers(0, 3),
       prefer=st.sampled_from(["earliest", "latest"]))
def test_agrees_with_the_rule_as_written(tokens, k, lo, extra, prefer):
    got = propose(arr(tokens), k, lo, lo + extra, prefer=prefer).tolist()
    assert got == reference(tokens, k, lo, lo + extra, prefer)
