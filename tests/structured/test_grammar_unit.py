"""The spec -> grammar -> mask path without a model: what validate() refuses and how it
names it, the compiled-grammar cache, and the mask rank 0 applies (worker_svc/grammar.py):
forbidden tokens -inf, allowed ones untouched, only EOS once the grammar is done, and
a matcher rebuilt by replaying output equal to one advanced token by token."""

from __future__ import annotations

import json
import re

import pytest
import torch

from shared.structured import compile_cache as so
from shared.structured.spec import StructuredOutputError, StructuredOutputSpec as Spec
from shared.types import InvalidRequestError, SamplingParams
from worker_svc.grammar import GrammarState, apply_masks

VOCAB_SIZE = 49152


@pytest.fixture(scope="module")
def vocab(tiny_model_dir):
    return so.grammar_vocab(tiny_model_dir, VOCAB_SIZE, [2])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    import tokenizers
    return tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


class Row:
    """What apply_masks reads of a WorkerRequest."""

    def __init__(self, grammar):
        self.grammar = grammar


def allowed(vocab, spec: Spec, after: list[int] = ()) -> torch.Tensor:
    state = GrammarState(so.compile_spec(spec, vocab).new_matcher())
    for t in after:
        state.advance(t)
    logits = torch.zeros(1, VOCAB_SIZE)
    apply_masks(logits, [Row(state)], [2])
    return logits[0] == 0


@pytest.mark.parametrize("spec, field, words", [
    (Spec("json", "{"), "json", "not valid JSON"),
    (Spec("json", '{"type": "strin"}'), "json", "strin"),
    (Spec("json", "[1, 2]"), "json", "must be an object"),
    (Spec("json", '{"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}'),
     "json", "uses a feature the backend does not support"),
    (Spec("regex", "(ab"), "regex", "invalid regex"),
    (Spec("regex", ""), "regex", "empty"),
    (Spec("choice", "[]"), "choice", "non-empty list"),
    (Spec("choice", '["a", 3]'), "choice", "non-empty list"),
    (Spec("grammar", "start: missing_rule"), "grammar", "missing_rule"),
    (Spec("xml"), "structured_output", "unknown structured output kind"),
])
def test_a_bad_spec_is_refused_with_the_part_at_fault_named(vocab, spec, field, words):
    with pytest.raises(StructuredOutputError) as info:
        so.validate(spec, vocab)
    assert info.value.field == field
    assert words in info.value.message


def test_good_specs_of_every_kind_compile(vocab):
    for spec in (Spec("json", json.dumps({"type": "object", "properties": {
                     "a": {"type": "integer", "minimum": 0, "maximum": 9}}})),
                 Spec("json_object"), Spec("regex", r"\d{3}"), Spec("choice", '["x", "y"]'),
                 Spec("grammar", 'start: "a" "b"+'),
                 Spec("grammar", 'root ::= "a" [0-9]+')):  # GBNF, llama.cpp's EBNF
        so.validate(spec, vocab)


def test_a_compile_past_the_timeout_is_a_clear_error(vocab):
    schema = {"type": "object", "required": [f"f{i}" for i in range(3000)],
              "properties": {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1},9}}$"}
                             for i in range(3000)}}
    with pytest.raises(StructuredOutputError, match="did not compile within 0.001 s"):
        so.validate(Spec("json", json.dumps(schema)), vocab, timeout_s=0.001)


def test_the_cache_compiles_a_spec_once_and_counts_hits(vocab):
    spec = Spec("regex", r"cache-test-[0-9]{4}")
    hits, misses = so.CACHE.hits, so.CACHE.misses
    first = so.compile_spec(spec, vocab)
    assert (so.CACHE.hits, so.CACHE.misses) == (hits, misses + 1)
    assert so.compile_spec(spec, vocab) is first
    assert (so.CACHE.hits, so.CACHE.misses) == (hits + 1, misses + 1)
    assert first.new_matcher() is not first.new_matcher()  # each request its own copy


def test_sampling_params_refuse_a_grammar_that_eos_could_not_end():
    spec = Spec("regex", "a+")
    for params in (SamplingParams(structured_output=spec, ignore_eos=True),
                   SamplingParams(structured_output=spec, min_tokens=2, max_tokens=4)):
        with pytest.raises(InvalidRequestError, match="structured_output"):
            params.validate()
    with pytest.raises(InvalidRequestError, match="kind"):
        SamplingParams(structured_output=Spec("yaml")).validate()


def test_the_mask_allows_exactly_the_tokens_the_grammar_allows(vocab, tokenizer):
    ok = allowed(vocab, Spec("regex", r"[0-9]{2}-x"))
    ids = ok.nonzero().flatten().tolist()
    assert ids and len(ids) < 200
    for t in ids:  # every allowed token is digits only (a prefix of the pattern)
        assert re.fullmatch(r"[0-9]{1,2}", tokenizer.decode([t])), tokenizer.decode([t])
    assert not ok[2]  # EOS only once the pattern is complete
    digit = tokenizer.token_to_id("5")
    assert ok[digit] and not ok[tokenizer.token_to_id("x")]


def test_logits_of_allowed_tokens_are_untouched_and_unconstrained_rows_too():
    matcher_free = Row(None)
    logits = torch.randn(2, VOCAB_SIZE)
    before = logits.clone()
    assert apply_masks(logits, [matcher_free, matcher_free], [2]) == 0.0
    assert torch.equal(logits, before)


def test_a_finished_grammar_allows_only_eos(vocab, tokenizer):
    ids = tokenizer.encode("yes", add_special_tokens=False).ids
    ok = allowed(vocab, Spec("choice", '["yes", "no"]'), ids)
    assert ok.nonzero().flatten().tolist() == [2]


def test_a_matcher_rebuilt_from_replayed_output_masks_like_the_one_that_lived(vocab, tokenizer):
    spec = Spec("json", json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}))
    text = '{"name": "ab'
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    lived = GrammarState(so.compile_spec(spec, vocab).new_matcher())
    masks = []
    for t in ids:
        lived.advance(t)
    logits = torch.zeros(1, VOCAB_SIZE)
    apply_masks(logits, [Row(lived)], [2])
    masks.append(logits.clone())
    rebuilt = GrammarState(so.compile_spec(spec, vocab).new_matcher())
    for t in ids:
        rebuilt.advance(t)
    logits = torch.zeros(1, VOCAB_SIZE)
    apply_masks(logits, [Row(rebuilt)], [2])
    assert torch.equal(logits, masks[0])
    fresh = allowed(vocab, spec)
    assert not torch.equal(fresh, masks[0][0] == 0)  # the state matters: the test can fail


def test_a_refused_token_drives_the_request_to_eos(vocab, tokenizer):
    state = GrammarState(so.compile_spec(Spec("regex", "[0-9]+"), vocab).new_matcher())
    state.advance(tokenizer.token_to_id("x"))  # cannot be sampled; if it were
    assert state.failed
    logits = torch.zeros(1, VOCAB_SIZE)
    apply_masks(logits, [Row(state)], [2])
    assert (logits[0] == 0).nonzero().flatten().tolist() == [2]
