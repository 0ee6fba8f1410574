"""Structured-output request shapes -> the spec the engine enforces, and every way
one is refused: a 400 naming the field, raised before anything is queued (the
translation is the last step before the scheduler)."""

from __future__ import annotations

import functools
import json

import pytest

from frontend_svc.errors import FieldError
from frontend_svc.api.protocol import ChatCompletionRequest, CompletionRequest
from frontend_svc.request.translate import (
    ModelLimits, chat_input, check_constraints, completion_inputs)
from shared.structured.spec import StructuredOutputSpec

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Where?"}]


@pytest.fixture(scope="module")
def limits():
    from shared.model_files.default_model import ensure_default_model
    from shared.structured.compile_cache import grammar_vocab
    return ModelLimits(256, 49152, grammar_vocab=functools.partial(
        grammar_vocab, str(ensure_default_model())))


def spec_of(tokenizer, limits, endpoint="completions", **body):
    if endpoint == "completions":
        [inp] = completion_inputs(CompletionRequest(prompt="x", **body), tokenizer, limits)
    else:
        inp = chat_input(ChatCompletionRequest(messages=MESSAGES, **body), tokenizer, limits)
    [inp] = check_constraints([inp], limits)  # the route's last step: compile
    return inp.params.structured_output, inp


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("body,expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "place", "strict": True, "schema": SCHEMA}}},
     StructuredOutputSpec("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputSpec("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     StructuredOutputSpec("json", json.dumps(SCHEMA), True)),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutputSpec("regex", "[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutputSpec("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}},
     StructuredOutputSpec("grammar", 'start: "a" | "b"')),
    ({"structured_outputs": {"json_object": True, "disable_fallback": True}},
     StructuredOutputSpec("json_object")),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     StructuredOutputSpec("json", json.dumps(SCHEMA))),  # strict already: vLLM's switch
    ({"guided_json": SCHEMA}, StructuredOutputSpec("json", json.dumps(SCHEMA))),
    ({"guided_regex": "a+"}, StructuredOutputSpec("regex", "a+")),
    ({"guided_choice": ["x", "y"]}, StructuredOutputSpec("choice", '["x", "y"]')),
    ({"guided_grammar": 'start: "z"'}, StructuredOutputSpec("grammar", 'start: "z"')),
])
def test_every_request_shape_becomes_its_spec(tokenizer, limits, endpoint, body, expected):
    spec, inp = spec_of(tokenizer, limits, endpoint, **body)
    assert spec == expected
    assert (inp.constraint is None) == (expected is None)


def test_every_choice_of_a_batch_carries_the_spec(tokenizer, limits):
    inputs = completion_inputs(CompletionRequest(prompt=["a", "b"], n=2,
                                                 guided_regex="[ab]"), tokenizer, limits)
    assert [i.params.structured_output.value for i in inputs] == ["[ab]", "[ab]"]
    assert check_constraints(inputs, limits) == inputs


def test_translation_refuses_shapes_at_once_and_compiles_only_in_check(tokenizer, limits):
    """The cheap checks refuse on the tokenizer pool; the compile (which may take up to
    the timeout) waits for check_constraints on the grammar pool."""
    req = CompletionRequest(prompt="x", structured_outputs={"regex": "(unclosed"})
    [inp] = completion_inputs(req, tokenizer, limits)  # a well-formed shape: no compile yet
    with pytest.raises(FieldError):
        check_constraints([inp], limits)
    assert check_constraints([], limits) == []


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "schema object"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", "one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}}},
     "response_format.json_schema.schema", "invalid"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "x"}},
     "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"regex": "a", "colour": 1}}, "structured_outputs.colour",
     "not a field"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace", "boolean"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": "yes"}},
     "structured_outputs.disable_additional_properties", "boolean"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "object"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice", "strings"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}},
     "structured_outputs.grammar", "grammar"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "true"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex", "one structured output"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "one structured output"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "one structured output"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
     "guided_json", "JSON schema"),
])
def test_every_bad_shape_is_a_400_naming_its_field(tokenizer, limits, body, param, words):
    with pytest.raises(FieldError) as info:
        spec_of(tokenizer, limits, **body)
    assert info.value.param == param
    assert words in str(info.value) and str(info.value).startswith(param.split(".")[0])


@pytest.mark.parametrize("name,words", [("guided_decoding_backend", "removed"),
                                        ("guided_whitespace_pattern", "disable_any_whitespace")])
def test_the_removed_fields_without_a_counterpart_are_refused(tokenizer, limits, name, words):
    with pytest.raises(FieldError) as info:
        spec_of(tokenizer, limits, guided_regex="a", **{name: "x"})
    assert info.value.param == name and words in str(info.value)


def test_a_compile_over_the_timeout_is_a_clear_400(tokenizer, limits, monkeypatch):
    import dataclasses
    import threading

    from shared.structured import compile_cache
    release = threading.Event()
    backend = compile_cache.CACHE.backend

    class Held:  # the real backend, whose compile takes longer than the limit
        name = "held"
        vocab = backend.vocab

        def compile(self, spec, vocab):
            release.wait(10)
            return backend.compile(spec, vocab)

    monkeypatch.setattr(compile_cache.CACHE, "backend", Held())
    tight = dataclasses.replace(limits, compile_timeout_s=0.05)
    try:
        with pytest.raises(FieldError) as info:
            spec_of(tokenizer, tight, structured_outputs={"regex": "[0-9]{1,7}x"})
    finally:
        release.set()
    assert info.value.param == "structured_outputs.regex"
    assert "did not compile within" in str(info.value)


def test_without_a_grammar_vocabulary_structured_outputs_are_refused_not_ignored(tokenizer):
    with pytest.raises(FieldError) as info:
        spec_of(tokenizer, ModelLimits(256, 49152), guided_choice=["a"])
    assert info.value.param == "guided_choice" and "not available" in str(info.value)
