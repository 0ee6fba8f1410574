"""Every family and variant, served by the real scheduler core and a real ModelRunner
in one process (tests/spec/engine_loop.py), gives transformers' greedy tokens under
chunked prefill with prefix-cache hits, under preemption, and with n-gram
speculation; the YaRN variant's requests run past its max_position_embeddings."""

from __future__ import annotations

import random

import pytest

from tests.families.conftest import VARIANTS
from tests.integration.hf_reference import hf_greedy
from tests.spec.conftest import NGRAM, make_runner
from tests.spec.engine_loop import run
from shared.types import SamplingParams

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 40, 3, 60)]
SHARED = [_rng.randrange(3, 256) for _ in range(40)]  # a prefix three prompts share
PREFIXED = [SHARED + [_rng.randrange(3, 256) for _ in range(n)] for n in (2, 9, 20)]

SETTINGS = {
    # prompts longer than the budget, several chunks each; three share 40 tokens
    "chunked_prefill_and_prefix_hits": dict(prompts=PROMPTS + PREFIXED,
                                            max_num_batched_tokens=16,
                                            long_prefill_token_threshold=8),
    # 12 blocks of 16 cannot hold five requests of 25 to 112 tokens: preemption
    "preemption": dict(prompts=PROMPTS, num_blocks=12, max_model_len=128),
    # prompt-lookup drafts of 3, verified and rolled back, under chunked prefill too
    "ngram_speculation": dict(prompts=PROMPTS + PREFIXED, max_num_batched_tokens=32,
                              spec=NGRAM % 3),
}


@pytest.fixture(scope="module")
def runners(family_dir):
    built = {}

    def get(name: str, spec: str | None):
        if (name, spec) not in built:
            built[name, spec] = make_runner(family_dir(name), spec)
        return built[name, spec]
    return get


@pytest.fixture(scope="module")
def reference(family_dir, hf_model_cache):
    cache = {}

    def get(name: str, prompt: list[int], n: int) -> list[int]:
        key = (name, tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(hf_model_cache(family_dir(name)), prompt, n)
        return cache[key]
    return get


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_equals_transformers_under_every_scheduling_rule(runners, reference, name,
                                                                setting):
    cfg = dict(SETTINGS[setting])
    prompts, spec = cfg.pop("prompts"), cfg.pop("spec", None)
    # request i wants 20 + 8 i tokens: they finish at different steps
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 8 * i, ignore_eos=True)
              for i in range(len(prompts))]
    steps: list = []
    runner = runners(name, spec)
    routed_before = sum(getattr(runner.model, "expert_tokens", ()))
    got, _, sched = run(runner, prompts, params, record=steps, **cfg)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference(name, prompt, 20 + 8 * i), (name, setting, i)
    st = sched.stats()
    if setting == "chunked_prefill_and_prefix_hits":
        assert st.prefix_cache_hits > 0
        assert max(so.total_num_scheduled_tokens for so in steps) <= 16
    if setting == "preemption":
        assert st.num_preemptions_total > 0
    if setting == "ngram_speculation":
        assert st.spec_num_draft_tokens > 0
    if name == "qwen2_yarn":  # its config's max_position_embeddings is 64
        assert max(len(p) + 20 + 8 * i for i, p in enumerate(prompts)) > 64
    assert sched.num_free_blocks == sched.num_total_blocks - 1
    moe = runner.model_config.moe
    if moe is not None and spec is None:  # every computed token went to top_k experts
        routed = sum(runner.model.expert_tokens) - routed_before
        computed = sum(so.total_num_scheduled_tokens for so in steps)
        assert routed == computed * moe.top_k * sum(runner.model_config.moe_layers)


def test_the_expert_load_metric_counts_each_experts_new_tokens():
    from prometheus_client import REGISTRY

    from worker_svc.metrics import WorkerTelemetry

    def value(expert: int) -> float:
        return REGISTRY.get_sample_value("gapserve:worker_moe_expert_tokens_total", {
            "model_name": "moe-metric-test", "rank": "0", "expert": str(expert)}) or 0.0
    telemetry = WorkerTelemetry("moe-metric-test")
    telemetry.expert_tokens([3, 0, 5])
    telemetry.expert_tokens([4, 2, 5])
    telemetry.expert_tokens(None)  # a dense model: nothing
    assert [value(e) for e in range(3)] == [4.0, 2.0, 5.0]
