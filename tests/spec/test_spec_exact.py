"""Speculative decoding is exact (docs/spec_decode.md): the real scheduler core and a
real ModelRunner (tests/spec/engine_loop.py) give, with drafts, token for token what
they give without them and what transformers' greedy loop gives, for every method and
k = 1..5, async scheduling on and off, and under chunked prefill, prefix-cache hits,
preemption, multi-step decode and priority scheduling. Seeded sampling, penalties,
min_tokens, logprobs and stop tokens among the drafts too."""

from __future__ import annotations

import random

import pytest

from shared.types import FinishReason, SamplingParams
from tests.integration.hf_reference import hf_greedy
from tests.spec.conftest import METHODS, make_runner, spec_json
from tests.spec.engine_loop import run

MAX_TOKENS = 40
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 40, 3, 60)]
SHARED = [_rng.randrange(3, 256) for _ in range(40)]  # a prefix three prompts share
PREFIXED = [SHARED + [_rng.randrange(3, 256) for _ in range(n)] for n in (2, 9, 20)]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def runners(target_dir, draft_dir):
    """One runner per configuration, built on first use (each run ends with every
    request finished, so a runner is reused clean)."""
    built = {}

    def get(method: str | None, k: int = 3, limit: int | None = None):
        key = (method, k, limit)
        if key not in built:
            built[key] = make_runner(target_dir, None if method is None
                                     else spec_json(method, k, draft_dir, limit))
        return built[key]
    return get


@pytest.fixture(scope="module")
def reference(hf_target):
    cache = {}

    def get(prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(hf_target, prompt, n)
        return cache[key]
    return get


def count(sched) -> tuple[int, int]:
    st = sched.stats()
    return st.spec_num_draft_tokens, st.spec_num_accepted_tokens


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_drafts_equals_decoding_without_and_transformers(
        runners, reference, method, k, async_scheduling):
    params = [greedy() for _ in PROMPTS]
    got, reasons, sched = run(runners(method, k), PROMPTS, params,
                              async_scheduling=async_scheduling)
    without, _, _ = run(runners(None), PROMPTS, params, async_scheduling=async_scheduling)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == without[f"r{i}"] == reference(prompt), (method, k, i)
    assert set(reasons.values()) == {FinishReason.LENGTH}
    proposed, accepted = count(sched)
    assert proposed and accepted  # drafts were proposed and some were right
    if method != "int8_self_draft":  # (the int8 copy of this tiny model is never wrong)
        assert accepted < proposed  # and some were wrong: rolled back, recomputed
    assert sched.num_free_blocks == sched.num_total_blocks - 1


SETTINGS = {
    # prompts longer than the budget, several chunks each; three share 40 tokens
    "chunked_prefill_and_prefix_hits": dict(prompts=PROMPTS + PREFIXED,
                                            max_num_batched_tokens=16,
                                            long_prefill_token_threshold=8),
    # 12 blocks of 16 cannot hold five requests of 25 to 112 tokens: preemption
    "preemption": dict(prompts=PROMPTS, num_blocks=12, max_model_len=128),
    # four passes a step while 3 or more run (no slots then), drafts once fewer do
    "multi_step": dict(prompts=PROMPTS, num_scheduler_steps=4, disable_by_batch_size=3),
    "priority": dict(prompts=PROMPTS, policy="priority", num_blocks=12, max_model_len=128),
}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_drafts_stays_exact_under_every_scheduling_rule(
        runners, reference, method, setting, async_scheduling):
    cfg = dict(SETTINGS[setting])
    prompts = cfg.pop("prompts")
    runner = runners(method, 3, cfg.pop("disable_by_batch_size", None))
    # request i wants 20 + 8 i tokens: they finish at different steps
    params = [greedy(20 + 8 * i) for i in range(len(prompts))]
    steps: list = []
    got, _, sched = run(runner, prompts, params, async_scheduling=async_scheduling,
                        record=steps, priorities=[i % 3 for i in range(len(prompts))],
                        **cfg)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference(prompt, 20 + 8 * i), (method, setting, i)
    st = sched.stats()
    proposed, accepted = count(sched)
    assert proposed and accepted
    if setting == "chunked_prefill_and_prefix_hits":
        assert st.prefix_cache_hits > 0
        assert max(so.total_num_scheduled_tokens for so in steps) <= 16
    if setting in ("preemption", "priority"):
        assert st.num_preemptions_total > 0
    if setting == "multi_step":
        assert any(so.num_steps > 1 for so in steps)
        assert not any(so.num_steps > 1 and so.num_draft_slots for so in steps)
    assert sched.num_free_blocks == sched.num_total_blocks - 1
