"""Gemma 2, Gemma 3 (text, and the text model of Gemma3ForConditionalGeneration),
Phi-3 with longrope and Phi-4-mini's partial rotary, and Mistral past its sliding
window: our logits are transformers' (float32, eager attention), and greedy decoding
through the real scheduler core (tests/spec/engine_loop.py) gives transformers'
tokens under chunked prefill, prefix-cache hits, preemption and n-gram speculation.
Prompts run past every sliding window (24 tokens) and generation past longrope's
pretraining length (64 positions)."""

from __future__ import annotations

import random

import pytest
import torch

from shared.types import SamplingParams
from tests.families.dense_checkpoints import VARIANTS, WINDOW, reference, write
from tests.integration.hf_reference import hf_greedy
from tests.spec.conftest import NGRAM, make_runner
from tests.spec.engine_loop import run
from tests.worker.test_model_matches_transformers import (_chunk_logits, _prompt,
                                                          _relative_error, _state)

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (5, 30, 45, 3)]
SHARED = [_rng.randrange(3, 256) for _ in range(40)]  # two prompts share 40 tokens
PREFIXED = [SHARED + [_rng.randrange(3, 256) for _ in range(n)] for n in (4, 11)]
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    written = {}

    def get(name: str):
        if name not in written:
            written[name] = write(name, tmp_path_factory.mktemp(name))
        return written[name]
    return get


@pytest.fixture(scope="module")
def hf(checkpoint):
    models = {}

    def get(name: str):
        if name not in models:
            models[name] = reference(checkpoint(name))
        return models[name]
    return get


@pytest.fixture(scope="module")
def greedy_reference(hf):
    cache = {}

    def get(name: str, prompt: list[int], n: int) -> list[int]:
        key = (name, tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(hf(name), prompt, n)
        return cache[key]
    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_of_a_prompt_past_the_window_match_transformers(variant, checkpoint, hf):
    prompt = _prompt(0, 50)  # past the 24-token window; within longrope's 64
    runner = make_runner(checkpoint(variant))
    got = _chunk_logits(runner, _state(prompt), len(prompt))
    with torch.no_grad():
        want = hf(variant)(torch.tensor([prompt])).logits[0]
    assert _relative_error(got, want) < 1e-4


@pytest.mark.parametrize("variant", ["mistral_sliding_window", "gemma2", "gemma3_text"])
def test_prompt_prefilled_in_chunks_across_the_window_gives_one_shot_logits(variant,
                                                                            checkpoint):
    prompt = _prompt(1, 70)
    one_shot = _chunk_logits(make_runner(checkpoint(variant)), _state(prompt), len(prompt))
    runner, state = make_runner(checkpoint(variant)), _state(prompt)
    chunks = [_chunk_logits(runner, state, n) for n in (7, 16, 30, 1, 16)]
    assert _relative_error(torch.cat(chunks), one_shot) < 1e-5


SETTINGS = {
    "plain": dict(prompts=PROMPTS),
    # a 16-token budget: prompts in several chunks; the first and the last share 40
    # tokens, and the last finds the first's blocks cached
    "chunked_prefill_and_prefix_hits": dict(prompts=PREFIXED[:1] + PROMPTS + PREFIXED[1:],
                                            max_num_batched_tokens=16,
                                            long_prefill_token_threshold=8),
    # 8 usable blocks of 16 cannot hold four requests of up to 75 tokens: preemption
    "preemption": dict(prompts=PROMPTS, num_blocks=9, max_model_len=128),
    "ngram_speculation": dict(prompts=PROMPTS, spec=NGRAM % 3),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_transformers_under_every_scheduling_rule(
        variant, setting, checkpoint, greedy_reference):
    cfg = dict(SETTINGS[setting])
    prompts, spec = cfg.pop("prompts"), cfg.pop("spec", None)
    runner = make_runner(checkpoint(variant), spec)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
              for _ in prompts]
    got, _, sched = run(runner, prompts, params, **cfg)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == greedy_reference(variant, prompt, MAX_TOKENS), (variant, i)
    st = sched.stats()
    if setting == "chunked_prefill_and_prefix_hits":
        assert st.prefix_cache_hits > 0
    if setting == "preemption":
        assert st.num_preemptions_total > 0
    if setting == "ngram_speculation":
        assert st.spec_num_draft_tokens > 0
    assert sched.num_free_blocks == sched.num_total_blocks - 1


_GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
_PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
              "original_max_position_embeddings": 64,
              "short_factor": [1.0 + 0.05 * i for i in range(8)],
              "long_factor": [1.0 + 0.05 * i for i in range(8)]}


@pytest.mark.parametrize("variant,change", [
    ("mistral_sliding_window", dict(sliding_window=512)),
    ("gemma2", dict(sliding_window=512)),
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(query_pre_attn_scalar=16)),
    ("gemma3_text", dict(sliding_window=512)),
    ("gemma3_text", dict(rope_parameters={**_GEMMA3_ROPE, "sliding_attention": {
        "rope_type": "default", "rope_theta": 10000.0}})),
    ("gemma3_text", dict(rope_parameters={**_GEMMA3_ROPE, "full_attention": {
        "rope_type": "default", "rope_theta": 1e6}})),
    ("gemma3_text_softcap", dict(final_logit_softcapping=None)),
    ("phi3_longrope", dict(rope_parameters=_PHI3_ROPE)),  # long factors = short ones
], ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_each_checkpoint_detail_moves_transformers_logits_past_the_tolerance(
        variant, change, checkpoint, hf):
    """The tiny checkpoints are sensitive to what the tests above hold us to: without
    the detail (a window wider than any context, no cap, another scale or RoPE),
    transformers' own logits over a prompt past the window, and past longrope's 64
    positions, move by at least twice the 1e-4 the logits test allows. (Greedy tokens
    alone are a weaker check here: Gemma's tiny checkpoints settle on repeating a
    token, whatever the detail.)"""
    import json

    import transformers
    path = checkpoint(variant)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    changed = getattr(transformers, arch).from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", **change).eval()
    prompt = _prompt(0, 70)
    with torch.no_grad():
        want = hf(variant)(torch.tensor([prompt])).logits[0]
        moved = changed(torch.tensor([prompt])).logits[0]
    assert _relative_error(moved, want) > 2e-4


def test_max_model_len_is_no_longer_capped_at_the_sliding_window(checkpoint):
    runner = make_runner(checkpoint("mistral_sliding_window"))
    assert runner.max_model_len == 256 > WINDOW
    assert "sliding_window=on" in runner.compute_plan.summary()
    assert runner.compute_plan.layer_loop != "c_loop"  # the C loop has no window
