"""--speculative-config (shared/speculative_config.py): vLLM's three shapes parse, with
vLLM's defaults; everything else is refused with a message that names the field."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.speculative_config import (
    KEYS, MAX_SPECULATIVE_TOKENS, SpeculativeConfig, SpeculativeConfigError,
    parse_speculative_config,
)


def parse(obj):
    return parse_speculative_config(json.dumps(obj))


def test_ngram_with_both_lookup_bounds():
    c = parse({"method": "ngram", "num_speculative_tokens": 4,
               "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert c == SpeculativeConfig("ngram", 4, 2, 5)
    assert not c.is_int8_self_draft


@pytest.mark.parametrize("given, want", [
    ({}, (5, 5)),  # vLLM's defaults
    ({"prompt_lookup_max": 3}, (3, 3)),  # one given sets the other
    ({"prompt_lookup_min": 4}, (4, 4)),
])
def test_ngram_lookup_defaults_follow_vllm(given, want):
    c = parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == want


def test_model_ngram_without_method_means_ngram():
    assert parse({"model": "ngram", "num_speculative_tokens": 3}).method == "ngram"


def test_draft_model_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    c = parse({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 5})
    assert (c.method, c.model, c.quantization, c.is_int8_self_draft) == \
        ("draft_model", str(tmp_path), None, False)


def test_method_defaults_to_draft_model_when_a_model_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert parse({"model": str(tmp_path), "num_speculative_tokens": 1}).method == "draft_model"


def test_int8_self_draft():
    c = parse({"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3,
               "disable_by_batch_size": 32})
    assert c.is_int8_self_draft and c.model is None and c.disable_by_batch_size == 32


def test_a_dict_is_accepted_and_empty_means_off():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 1}).method \
        == "ngram"
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("  ") is None


def test_disable_by_batch_size_switches_per_step():
    c = parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4})
    assert [c.speculates(n) for n in (1, 3, 4, 9)] == [True, True, False, False]
    assert parse({"method": "ngram", "num_speculative_tokens": 2}).speculates(10_000)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"num_speculative_tokens": 2}', "needs a method"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not served"),
    ('{"method": "lookahead", "num_speculative_tokens": 2}', "unknown method 'lookahead'"),
    ('{"method": 3, "num_speculative_tokens": 2}', "method must be a string"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in"),
    (json.dumps({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}),
     "num_speculative_tokens must be in"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
     "prompt_lookup_min must be at least 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}', "takes no model"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}',
     "takes no quantization"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}',
     "disable_by_batch_size must be at least 2"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}',
     "unsupported key(s) draft_tensor_parallel_size"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a model"),
    ('{"method": "draft_model", "quantization": "fp8", "num_speculative_tokens": 2}',
     "quantization 'fp8' is not served"),
    ('{"method": "draft_model", "model": "/no/such/dir", "num_speculative_tokens": 2}',
     "not a local checkpoint directory"),
    ('{"method": "draft_model", "model": "org/name", "num_speculative_tokens": 2}',
     "not a local checkpoint directory"),
    ('{"method": "draft_model", "model": "/x", "quantization": "int8", '
     '"num_speculative_tokens": 2}', "takes no model"),
    ('{"method": "draft_model", "model": "/x", "prompt_lookup_min": 2, '
     '"num_speculative_tokens": 2}', 'belongs to method "ngram"'),
])
def test_bad_configs_are_refused_by_name(text, message):
    with pytest.raises(SpeculativeConfigError) as e:
        parse_speculative_config(text)
    assert message in str(e.value)


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=False),
                   st.text(max_size=8), st.lists(st.integers(), max_size=2),
                   st.sampled_from(["ngram", "draft_model", "eagle", "int8", "[ngram]"]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(obj=st.dictionaries(st.sampled_from([*KEYS, "other"]), VALUES, max_size=5))
def test_any_json_object_parses_or_is_refused_with_a_named_error(obj):
    try:
        c = parse_speculative_config(json.dumps(obj))
    except SpeculativeConfigError as e:
        assert str(e)
        return
    assert c is not None and c.method in ("ngram", "draft_model")
    assert 1 <= c.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS


@pytest.mark.parametrize("obj", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
     "prompt_lookup_max": 4, "disable_by_batch_size": 8},
    {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 5},
])
def test_the_canonical_json_the_handshake_carries_parses_back_to_the_same_config(obj):
    c = parse(obj)
    assert parse_speculative_config(c.to_json()) == c
    assert parse_speculative_config(c.to_json()).to_json() == c.to_json()


def test_the_worker_flag_refuses_a_bad_config_naming_the_field():
    from shared.config import parse_args, worker_parser
    with pytest.raises(SystemExit):
        parse_args(worker_parser(), ["--speculative-config",
                                     '{"method": "ngram", "num_speculative_tokens": 0}'],
                   environ={})
    args = parse_args(worker_parser(), [], environ={
        "GAPSERVE_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 2}'})
    assert args.speculative_config == SpeculativeConfig("ngram", 2, 5, 5)
