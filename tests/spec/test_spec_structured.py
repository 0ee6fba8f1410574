"""Speculative decoding under structured outputs (docs/spec_decode.md, "Grammars"):
rank 0 keeps only the drafts the grammar allows, masks every verify row with the
matcher after the drafts before it, rolls the matcher back to the committed tokens,
and the self-draft drafts under the mask. Greedy constrained output is the same with
and without drafts, async and sync, and transformers' with the grammar applied as a
logits processor; seeded constrained sampling too."""

from __future__ import annotations

import json

import pytest
import torch

from shared.structured import compile_cache as so
from shared.structured.spec import StructuredOutputSpec
from shared.types import SamplingParams
from tests.spec.conftest import make_runner, spec_json
from tests.spec.engine_loop import run
from tests.structured.reference import GrammarLogitsProcessor, hf_constrained_greedy

SPECS = [
    StructuredOutputSpec("regex", "[a-z]{2,8}( [a-z]{2,8}){5}"),
    StructuredOutputSpec("json", json.dumps({
        "type": "object", "additionalProperties": False, "required": ["name", "tags"],
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "tags": {"type": "array", "maxItems": 3,
                                "items": {"type": "string", "maxLength": 6}}}}),
        disable_any_whitespace=True),
    StructuredOutputSpec("choice", json.dumps(["alpha beta gamma", "alpha beta delta"])),
]
PROMPTS = [[1, 504, 3209, 28, 253], [7, 8, 9, 10, 11] * 3, list(range(100, 130))]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def tiny_dir():
    from tests.integration.tiny_model import tiny_llama_dir
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def references(tiny_dir):
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    vocab = so.grammar_vocab(str(tiny_dir), hf.config.vocab_size, [hf.config.eos_token_id])
    return [hf_constrained_greedy(hf, p, MAX_TOKENS, GrammarLogitsProcessor(s, vocab),
                                  {hf.config.eos_token_id}) for p, s in zip(PROMPTS, SPECS)]


def params(seed: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0 if seed is None else 0.7, max_tokens=MAX_TOKENS,
                           structured_output=s, seed=None if seed is None else seed + i)
            for i, s in enumerate(SPECS)]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("method", ["ngram", "int8_self_draft"])
def test_constrained_greedy_with_drafts_equals_transformers_with_the_grammar(
        tiny_dir, references, method, async_scheduling):
    runner = make_runner(tiny_dir, spec_json(method, 4))
    got, reasons, sched = run(runner, PROMPTS, params(), async_scheduling=async_scheduling)
    for i, want in enumerate(references):
        assert got[f"r{i}"] == want, (method, i)
    st = sched.stats()
    assert st.spec_num_draft_tokens > 0  # drafts were verified under the masks
    if method == "int8_self_draft":
        assert st.spec_num_accepted_tokens > 0
    assert sched.num_free_blocks == sched.num_total_blocks - 1


def test_seeded_constrained_sampling_with_drafts_gives_the_tokens_it_gives_without(tiny_dir):
    plain = make_runner(tiny_dir)
    drafting = make_runner(tiny_dir, spec_json("int8_self_draft", 3))
    want, _, _ = run(plain, PROMPTS, params(seed=11))
    got, _, sched = run(drafting, PROMPTS, params(seed=11))
    assert got == want
    assert sched.stats().spec_num_draft_tokens > 0
