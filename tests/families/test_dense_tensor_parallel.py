"""Gemma 2/3, Phi-3/4-mini and Mistral past its window on two tensor-parallel worker
ranks (real processes joined in one gloo group, driven over their gRPC Step streams
through the real scheduler core): heads, MLP rows and the vocabulary split, q/k norms
and soft-caps on whole heads and gathered logits; with n-gram speculation and a pool
small enough to preempt, greedy tokens equal transformers' float32 ones."""

from __future__ import annotations

import pytest

from shared.types import SamplingParams
from tests.families.dense_checkpoints import reference, write
from tests.integration.hf_reference import hf_greedy
from tests.integration.test_tensor_parallel import SMALL_POOL, _addresses, _ranks
from tests.integration.tp_group import RankGroupClient
from tests.spec.conftest import NGRAM
from tests.spec.engine_loop import run

# past the 24-token window, and (with 30 generated) past longrope's 64 positions
PROMPTS = [[1, 50, 32, 28, 253, 48, 99] * 6, [7, 8, 9, 10, 11] * 4, [42] * 3]
MAX_TOKENS = 30


@pytest.mark.e2e
@pytest.mark.parametrize("variant", ["mistral_sliding_window", "gemma2", "gemma3_text",
                                     "gemma3_multimodal_text", "phi3_longrope",
                                     "phi4_mini_partial_rotary"])
def test_two_ranks_with_ngram_drafts_and_preemption_are_greedy_equal_to_transformers(
        tmp_path, variant):
    path = write(variant, tmp_path / variant)
    stack = _ranks(path, tmp_path / "logs",
                   flags=[*SMALL_POOL, "--speculative-config", NGRAM % 3])
    try:
        group = RankGroupClient(_addresses(stack))
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
                  for _ in PROMPTS]
        got, _, sched = run(group, PROMPTS, params, num_blocks=8, max_model_len=96)
        group.close()
    finally:
        stack.stop()
    hf = reference(path)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == hf_greedy(hf, prompt, MAX_TOKENS), (variant, i)
    st = sched.stats()
    assert st.num_preemptions_total > 0 and st.spec_num_draft_tokens > 0
