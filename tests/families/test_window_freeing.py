"""A model whose every layer attends within a sliding window (Mistral v0.1's layout)
runs requests several windows long in a pool too small to hold one of them whole:
the scheduler frees the blocks behind each request's window as it advances
(shared/kv_window.py), the worker's attention never reads them, and greedy tokens
stay transformers' under chunked prefill, windowed prefix hits, preemption and n-gram
speculation, with every block back in the pool at the end."""

from __future__ import annotations

import random

import pytest

from shared.kv_window import max_blocks_per_request
from shared.types import SamplingParams
from tests.families.dense_checkpoints import WINDOW, reference, write
from tests.integration.hf_reference import hf_greedy
from tests.spec.conftest import NGRAM, make_runner
from tests.spec.engine_loop import run

_rng = random.Random(5)
FIRST = [_rng.randrange(3, 256) for _ in range(73)]
OTHERS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (50, 9)]
MAX_TOKENS = 40  # 50 to 113 prompt tokens + 40: up to six windows of 24
BUDGET = 16


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = write("mistral_sliding_window", tmp_path_factory.mktemp("mistral_window"))
    return path, reference(path)


@pytest.fixture(scope="module")
def prompts(mistral):
    """The second prompt continues the first with its own greedy output, so it may hit
    the blocks the first left cached at the end of its window."""
    hf = mistral[1]
    return [FIRST, FIRST + hf_greedy(hf, FIRST, MAX_TOKENS)[:36] + [7], *OTHERS]


@pytest.fixture(scope="module")
def want(mistral, prompts):
    return [hf_greedy(mistral[1], p, MAX_TOKENS) for p in prompts]


SETTINGS = {
    # one request at a time: each passes through the pool's 5 usable blocks of 16,
    # fewer than its 8 blocks; the second finds the first's last window cached
    "one_at_a_time_with_windowed_prefix_hits": dict(max_num_seqs=1),
    # all four at once in 9 usable blocks: they preempt one another
    "preemption": dict(num_blocks=10),
    "ngram_speculation": dict(spec=NGRAM % 3, num_blocks=8),
    "sync_scheduling": dict(async_scheduling=False, max_num_seqs=2),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_requests_several_windows_long_fit_a_pool_smaller_than_one_of_them(
        mistral, prompts, want, setting):
    cfg = dict(SETTINGS[setting])
    spec = cfg.pop("spec", None)
    runner = make_runner(mistral[0], spec)
    info = runner.model_info()
    assert info.sliding_window == WINDOW
    k = 3 if spec else 0
    floor = max_blocks_per_request(256, 16, WINDOW, BUDGET, k)
    cfg.setdefault("num_blocks", 1 + floor)
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    assert cfg["num_blocks"] - 1 < -(-longest // 16)  # not even one request fits whole
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
              for _ in prompts]
    got, _, sched = run(runner, prompts, params, max_num_batched_tokens=BUDGET,
                        max_model_len=256, **cfg)
    for i in range(len(prompts)):
        assert got[f"r{i}"] == want[i], (setting, i)
    st = sched.stats()
    assert st.num_window_freed_blocks_total > 0
    assert sched.num_free_blocks == sched.num_total_blocks - 1
    if setting == "one_at_a_time_with_windowed_prefix_hits":
        assert st.prefix_cache_hits > 0
    if setting == "preemption":
        assert st.num_preemptions_total > 0
    if setting == "ngram_speculation":
        assert st.spec_num_draft_tokens > 0


def test_a_model_with_one_full_attention_layer_frees_nothing(tmp_path):
    """Gemma 3's pattern mixes sliding and global layers: a global layer reads every
    key, so no block is ever behind every layer's window."""
    runner = make_runner(write("gemma3_text", tmp_path / "g"))
    assert runner.model_info().sliding_window == 0
