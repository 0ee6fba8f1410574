"""Speculative decoding on the default model (SmolLM2-135M-Instruct, fp32): with prompt
lookup and with the int8 self-draft, greedy output equals transformers' token for
token, with chunked prefill, a pool small enough to preempt, and async scheduling; and
the drafts are right where they should be (the self-draft nearly everywhere, prompt
lookup on an answer that repeats the prompt)."""

from __future__ import annotations

import pytest
import torch

from shared.speculative_config import parse_speculative_config
from shared.types import SamplingParams
from tests.integration.hf_reference import greedy_references
from tests.spec.engine_loop import run

QUESTIONS = [
    "Fix the typos in this paragraph and return the corrected paragraph:\nThe weathr in "
    "Paris is usualy mild in the spring. Many tourists visit the city to see the Eiffel "
    "Tower and the beautifull gardens along the river Seine.",
    "Write a haiku about the sea.",
    "Explain in one sentence what a prime number is.",
]
MAX_TOKENS = 40
SPECS = {
    "ngram": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
             '"prompt_lookup_max": 4}',
    "int8_self_draft": '{"method": "draft_model", "quantization": "int8", '
                       '"num_speculative_tokens": 4}',
}


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    from shared.model_files.default_model import resolve_model
    model_dir = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                       add_generation_prompt=True, return_dict=True)
               ["input_ids"] for q in QUESTIONS]
    return model_dir, prompts, greedy_references(model_dir, prompts, MAX_TOKENS)


@pytest.mark.e2e
@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_with_drafts_equals_transformers_on_the_default_model(setup, method):
    from worker_svc.config import WorkerConfig
    from worker_svc.runner import ModelRunner
    model_dir, prompts, want = setup
    runner = ModelRunner(WorkerConfig(model=str(model_dir), device="cpu", max_model_len=512,
                                      num_gpu_blocks_override=64, max_num_seqs=4,
                                      speculative_config=parse_speculative_config(
                                          SPECS[method])))
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 3
    # 12 blocks of 16 for three requests of ~50-95 tokens: preemption; 32-token chunks
    got, _, sched = run(runner, prompts, params, num_blocks=12, max_model_len=128,
                        max_num_batched_tokens=32)
    for i in range(len(prompts)):
        assert got[f"r{i}"] == want[i], (method, i)
    st = sched.stats()
    assert st.num_preemptions_total > 0
    # the self-draft is the same model at int8's rounding: nearly every draft is right;
    # prompt lookup finds the paragraph the first answer repeats (the other two answers
    # repeat nothing: its drafts there are mostly wrong)
    floor = 0.8 if method == "int8_self_draft" else 0.15
    assert st.spec_acceptance_rate > floor, st
