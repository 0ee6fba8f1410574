"""Strict schemas: an object schema that declares properties and says nothing
about others (what pydantic, LangChain and instructor send) admits only its
declared keys, as vLLM's default backend compiles it; a schema that allows more
keeps them."""

from __future__ import annotations

import json

import pytest

from shared.structured import compile_cache as so
from shared.structured.spec import strict_schema
from shared.structured.spec import StructuredOutputSpec as Spec

PYDANTIC_CITY = {  # pydantic's model_json_schema() of class City(BaseModel): name: str
    "title": "City", "type": "object", "required": ["name", "home"],
    "properties": {"name": {"title": "Name", "type": "string"},
                   "home": {"$ref": "#/$defs/Home"}},
    "$defs": {"Home": {"title": "Home", "type": "object",
                       "properties": {"street": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def vocab(tiny_model_dir):
    return so.grammar_vocab(tiny_model_dir, 49152, [2])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    import tokenizers
    return tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def accepts(vocab, tokenizer, schema: dict, text: str) -> bool:
    matcher = so.compile_spec(Spec("json", json.dumps(schema)), vocab).new_matcher()
    tokens = tokenizer.encode(text).ids
    return matcher.validate(tokens) == len(tokens)


def test_objects_that_declare_properties_forbid_undeclared_ones_at_every_depth():
    strict = strict_schema(PYDANTIC_CITY)
    assert strict["additionalProperties"] is False
    assert strict["$defs"]["Home"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["name"]  # a string schema


def test_a_schema_that_allows_more_keys_keeps_them():
    for allowed in (True, {"type": "integer"}):
        schema = {"type": "object", "properties": {"a": {}}, "additionalProperties": allowed}
        assert strict_schema(schema) == schema
    bare = {"type": "object"}  # no properties declared: any object, as json_object
    assert strict_schema(bare) == bare


def test_a_property_named_properties_is_a_name_not_a_schema():
    schema = {"type": "object", "properties": {"properties": {"type": "string"}}}
    assert strict_schema(schema)["properties"] == {"properties": {"type": "string"}}


def test_the_grammar_refuses_an_undeclared_key_and_takes_the_declared_ones(vocab, tokenizer):
    ok = '{"name": "Oslo", "home": {"street": "Main"}}'
    assert accepts(vocab, tokenizer, PYDANTIC_CITY, ok)
    assert not accepts(vocab, tokenizer, PYDANTIC_CITY, '{"name": "Oslo", "weather"')
    assert not accepts(vocab, tokenizer, PYDANTIC_CITY,
                       '{"name": "Oslo", "home": {"street": "Main", "zip"')
