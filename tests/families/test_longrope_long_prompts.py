"""Phi-3's longrope past original_max_position_embeddings (64 here), exactly as
transformers computes it: its rotary embedding picks the factor set per forward call
from the call's longest position, so a prompt longer than 64 has every token rotated
with the long factors (its one-call prefill), and a shorter prompt keeps the short
set for its positions below 64 while each token generated past it rotates long. We
pick per request and position by the same rule (worker_svc/model/layers.py
longrope_rows), independent of how the prompt is chunked, and the prefix cache keeps
the two kinds of prompt apart (their KV differs for the same tokens)."""

from __future__ import annotations

import random

import pytest
import torch

from shared.types import SamplingParams
from tests.families.dense_checkpoints import reference, write
from tests.integration.hf_reference import hf_greedy
from tests.spec.conftest import NGRAM, make_runner
from tests.spec.engine_loop import run

_rng = random.Random(21)
LONG = [_rng.randrange(3, 256) for _ in range(90)]
# past 64: all long; within 64 sharing LONG's first 48 tokens (3 blocks): short below 64
PROMPTS = [LONG, LONG[:48] + [_rng.randrange(3, 256) for _ in range(10)],
           [_rng.randrange(3, 256) for _ in range(70)], LONG[:48] + [9, 9]]
MAX_TOKENS = 20

SETTINGS = {
    "chunked_prefill_and_prefix_hits": dict(max_num_batched_tokens=16,
                                            long_prefill_token_threshold=8),
    "preemption": dict(num_blocks=9, max_model_len=128),
    "ngram_speculation": dict(spec=NGRAM % 3),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    written = {}

    def get(name):
        if name not in written:
            path = write(name, tmp_path_factory.mktemp(name))
            written[name] = (path, reference(path))
        return written[name]
    return get


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("variant", ["phi3_longrope", "phi4_mini_partial_rotary"])
def test_greedy_tokens_of_prompts_past_the_pretraining_length_equal_transformers(
        checkpoint, variant, setting):
    path, hf = checkpoint(variant)
    cfg = dict(SETTINGS[setting])
    runner = make_runner(path, cfg.pop("spec", None))
    assert runner.model_info().long_prompt_rope_from == 64
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
              for _ in PROMPTS]
    got, _, sched = run(runner, PROMPTS, params, **cfg)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == hf_greedy(hf, prompt, MAX_TOKENS), (variant, setting, i)
    if setting == "chunked_prefill_and_prefix_hits":  # the short ones share blocks
        assert sched.stats().prefix_cache_hits > 0
    assert sched.num_free_blocks == sched.num_total_blocks - 1


def _greedy_logprobs(hf, prompt: list[int], n: int) -> list[float]:
    """transformers' greedy loop (hf_greedy's calls), each chosen token's logprob."""
    ids, out, cache = torch.tensor([prompt]), [], None
    with torch.no_grad():
        for _ in range(n):
            step = hf(ids if cache is None else ids[:, -1:], past_key_values=cache,
                      use_cache=True)
            cache = step.past_key_values
            logprobs = torch.log_softmax(step.logits[0, -1].float(), -1)
            token = int(logprobs.argmax())
            out.append(float(logprobs[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def test_logprobs_of_a_prompt_past_the_pretraining_length_equal_transformers(checkpoint):
    """Closer than greedy tokens, which the tiny checkpoint's small difference leaves
    alone: the per-position rule (long set from position 64 on, short below, for every
    prompt) is ~2e-5 off here; the exact rule within float rounding."""
    path, hf = checkpoint("phi3_longrope")
    runner = make_runner(path)
    got: list[float] = []
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)]
    run(runner, [LONG], params, max_num_batched_tokens=16,
        on_output=lambda out: got.extend(lp.logprob for lp in out.new_logprobs))
    want = _greedy_logprobs(hf, LONG, 8)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-6


def test_a_long_prompt_and_a_short_one_share_no_cached_block():
    from scheduler_svc.core.block_hash import BlockHasher
    from scheduler_svc.core.request import Request
    hasher = BlockHasher(16, "seed", long_prompt_rope_from=64)
    long_req, short_req = (Request(r, p, SamplingParams()) for r, p in
                           (("a", LONG), ("b", PROMPTS[1])))
    hasher(long_req)
    hasher(short_req)
    assert not set(long_req.block_hashes) & set(short_req.block_hashes)
    plain = BlockHasher(16, "seed")
    long_req.block_hashes, short_req.block_hashes = [], []
    plain(long_req)
    plain(short_req)
    assert long_req.block_hashes[:3] == short_req.block_hashes[:3]
