"""The tool-call parsers on streamed text: whatever the split points (every one of
them, and random ones from hypothesis), the concatenated deltas equal the
non-streamed answer, a call opens with index, id, type and name before any
argument fragment, and split tags are held back rather than leaked as content."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_svc.structured.tool_parsers import (
    HermesParser, Llama3JsonParser, NamedParser, RequiredParser, collect, parse_all)


def ids():
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


def make(kind: str, **kwargs):
    if kind == "named":
        return NamedParser("get_weather", ids(), **kwargs)
    cls = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
           "required": RequiredParser}[kind]
    return cls(ids(), **kwargs)


def streamed(kind: str, pieces: list[str], **kwargs) -> list[dict]:
    """The stream as a client that honours the final chunk's cut_tool_calls sees it."""
    parser = make(kind, **kwargs)
    bodies = []
    for piece in pieces:
        bodies += parser.feed(piece)
    bodies += parser.finish()
    cut = {c["index"] for c in parser.cut}
    return [b for b in bodies if not any(d["index"] in cut for d in b.get("tool_calls", ()))]


def whole(kind: str, text: str, **kwargs):
    return parse_all(make(kind, **kwargs), text)


def split_at(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def check_shape(bodies: list[dict]) -> None:
    """OpenAI's streaming order: each call's first delta has id, type and name
    with arguments "", later deltas only argument fragments."""
    opened = set()
    for body in bodies:
        assert set(body) in ({"content"}, {"tool_calls"}), body
        for delta in body.get("tool_calls", ()):
            if delta["index"] not in opened:
                assert delta["id"] and delta["type"] == "function"
                assert delta["function"]["name"] and delta["function"]["arguments"] == ""
                opened.add(delta["index"])
            else:
                assert set(delta) == {"index", "function"}
                assert set(delta["function"]) == {"arguments"}


HERMES = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": [1, 2]}}\n</tool_call>',
    '<tool_call>{"arguments": {"q": "a<tool_call>b"}, "name": "search"}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    'no tools here, just a < sign and <tool_ and a tag-like <tool_call',
    '<tool_call>not json</tool_call> then text',
    '<tool_call>{"name": "f", "arguments": {"s": "x\\"}y"}} trailing junk</tool_call>after',
    '<tool_call>{"name": "f"}</tool_call>',
    'Sure! <tool_call>{"name": "f", "arguments": {"a": 1}',  # cut by max_tokens
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
    '  leading and trailing space  ',
    '<tool_call>{"name": "f", "arguments": 7}</tool_call>',
    # malformed blocks with whitespace around them: content must stay exact
    'Hi there \n\n<tool_call>not json</tool_call>\n bye ',
    ' \t<tool_call>{"name": 5}</tool_call>',
    'a\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n '
    '<tool_call>{oops</tool_call> b',
    'end \n<tool_call>{"arguments": {"a": 1}',  # cut before the name: content
    # the model's own spacing, escapes and number forms: re-serialized as json.dumps does
    '<tool_call>{"name":"f","arguments":{"city" :"Par\\u00e9s","n":1.50,"e":1E2,'
    '"l":[ true,null ,-0],"s":"\\/\\ud83d\\ude00\\t"}}</tool_call>',
]
LLAMA3 = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1]}}',
    'Plain text answer {"name": "x"}',
    '  {"name": "f", "arguments": {"k": "v"}} then words',
    '{"name": "f", "parameters": {"k": ',
    '{broken',
    '  \n{broken',
    ' <|python_tag|>{"name": 1}',
    '{"name": "a", "parameters": {}}; {"bad"',
    '{"name":"f","parameters":{"k":"\\u00fc","n":2.0e0}}',
]
REQUIRED = [
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
    '[ {"name": "a", "parameters": {}} ,\n {"name": "b", "parameters": {"n": 3}} ]',
    '[{"parameters": {"z": true}, "name": "late_name"}]',
    '[{"name":"f","parameters":{"a":[1,2],"b":"\\u00e9"}}]',
]
NAMED = ['{"city": "Paris", "days": 3}', '  \n{"a": [1, 2]}\n  ', '']
CASES = [("hermes", t) for t in HERMES] + [("llama3_json", t) for t in LLAMA3] + \
    [("required", t) for t in REQUIRED] + [("named", t) for t in NAMED]


@pytest.mark.parametrize("kind,text", CASES)
def test_every_single_split_point_gives_the_non_streamed_answer(kind, text):
    expected = whole(kind, text)
    for cut in range(len(text) + 1):
        bodies = streamed(kind, [text[:cut], text[cut:]])
        check_shape(bodies)
        assert collect(bodies) == expected, (cut, bodies)
    bodies = streamed(kind, list(text))  # one character a delta
    check_shape(bodies)
    assert collect(bodies) == expected


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_random_splits_give_the_non_streamed_answer(case, cuts):
    kind, text = case
    bodies = streamed(kind, split_at(text, cuts))
    check_shape(bodies)
    assert collect(bodies) == whole(kind, text)


@settings(max_examples=60, deadline=None)
@given(prefix=st.text(alphabet="ab <>/_tolc\n", max_size=12),
       args=st.dictionaries(st.sampled_from(["a", "b", "c"]),
                            st.one_of(st.integers(), st.text(max_size=5)), max_size=3),
       cuts=st.lists(st.integers(0, 120), max_size=10))
def test_generated_hermes_calls_are_recovered_exactly(prefix, args, cuts):
    call = json.dumps({"name": "fn", "arguments": args})
    text = f"{prefix}<tool_call>\n{call}\n</tool_call>"
    content, calls = collect(streamed("hermes", split_at(text, cuts)))
    assert content == whole("hermes", text)[0]
    assert calls and json.loads(calls[-1]["function"]["arguments"]) == args
    assert calls[-1]["function"]["name"] == "fn"


def test_hermes_content_and_calls():
    content, calls = whole("hermes", HERMES[0])
    assert content == "Let me check."
    assert calls == [{"id": "call-0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}}]
    content, calls = whole("hermes", HERMES[1])
    assert content is None and [c["function"]["name"] for c in calls] == ["search", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "a<tool_call>b"}


def test_hermes_text_without_calls_is_kept_whole_including_tag_prefixes():
    for text in (HERMES[2], HERMES[8]):
        assert whole("hermes", text) == (text, [])


def test_hermes_a_split_tag_is_held_back_not_leaked():
    parser = make("hermes")
    assert parser.feed("Hi <tool") == [{"content": "Hi"}]  # the space waits too
    assert parser.feed("_ca") == []
    out = parser.feed('ll>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert out[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert collect(out + parser.finish())[1][0]["function"]["arguments"] == '{"x": 1}'


def test_hermes_broken_blocks():
    assert whole("hermes", HERMES[3]) == ("<tool_call>not json</tool_call> then text", [])
    content, calls = whole("hermes", HERMES[4])
    assert content == "after" and calls[0]["function"]["arguments"] == '{"s": "x\\"}y"}'
    assert whole("hermes", HERMES[5])[1][0]["function"]["arguments"] == "{}"
    content, calls = whole("hermes", HERMES[6])  # cut: the call stands as far as it got
    assert content == "Sure!" and calls[0]["function"]["arguments"] == '{"a": 1}'
    assert whole("hermes", HERMES[7])[1] == []  # a name that is not a string: content


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    content, calls = whole("hermes", HERMES[1], max_calls=1)
    assert [c["function"]["name"] for c in calls] == ["search"] and content is None
    assert len(whole("llama3_json", LLAMA3[1], max_calls=1)[1]) == 1
    assert len(whole("required", REQUIRED[1], max_calls=1)[1]) == 1


def test_llama3_json():
    content, calls = whole("llama3_json", LLAMA3[0])
    assert content is None and calls[0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [c["function"]["name"] for c in whole("llama3_json", LLAMA3[1])[1]] == ["a", "b"]
    assert whole("llama3_json", LLAMA3[2]) == (LLAMA3[2], [])
    content, calls = whole("llama3_json", LLAMA3[3])
    assert content == "then words" and calls[0]["function"]["arguments"] == '{"k": "v"}'
    assert whole("llama3_json", LLAMA3[5]) == ("{broken", [])


def test_required_and_named():
    content, calls = whole("required", REQUIRED[1])
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("a", {}), ("b", {"n": 3})]
    assert whole("required", REQUIRED[2])[1][0]["function"]["name"] == "late_name"
    content, calls = whole("named", NAMED[1])
    assert content is None and calls[0]["function"] == {"name": "get_weather",
                                                        "arguments": '{"a": [1, 2]}'}
    assert whole("named", "")[1] == []  # no arguments at all: cut, not "{}"


def test_a_malformed_block_falls_back_to_exactly_the_model_s_text():
    """Text around a block that never became a call keeps every character,
    whitespace before the tag included (issue 30: it used to be dropped)."""
    for kind, text in [("hermes", HERMES[10]), ("hermes", HERMES[11]),
                       ("hermes", HERMES[13]), ("llama3_json", LLAMA3[6]),
                       ("llama3_json", LLAMA3[7])]:
        assert whole(kind, text) == (text, []), text
    content, calls = whole("hermes", HERMES[12])  # a call, then a broken block
    assert [c["function"]["name"] for c in calls] == ["f"]
    assert content == "a<tool_call>{oops</tool_call> b"  # whitespace next to the call goes
    content, calls = whole("llama3_json", LLAMA3[8])
    assert content == "; {\"bad\"" and [c["function"]["name"] for c in calls] == ["a"]


def test_arguments_are_re_serialized_as_vllm_s_hermes_parser_does():
    """vLLM: arguments=json.dumps(parsed["arguments"], ensure_ascii=False), for
    hermes, llama3_json and required; a named call's reply is passed as written."""
    for kind, text in [("hermes", HERMES[14]), ("llama3_json", LLAMA3[9]),
                       ("required", REQUIRED[3])]:
        _, calls = whole(kind, text)
        parsed = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        args = parsed[0]["parameters"] if kind == "required" else \
            parsed.get("arguments", parsed.get("parameters"))
        assert calls[0]["function"]["arguments"] == json.dumps(args, ensure_ascii=False)
    assert json.loads(whole("hermes", HERMES[14])[1][0]["function"]["arguments"])["s"] \
        == "/\U0001F600\t"
    assert whole("named", '{"a":1}')[1][0]["function"]["arguments"] == '{"a":1}'


@settings(max_examples=60, deadline=None)
@given(ws=st.text(alphabet=" \n\t", max_size=4), words=st.text(alphabet="ab .", max_size=6),
       bad=st.sampled_from(["not json", '{"name": 5}', "{oops", '{"arguments": {}, "x"', ""]),
       close=st.booleans(), cuts=st.lists(st.integers(0, 80), max_size=10))
def test_generated_broken_blocks_keep_the_content_exact(ws, words, bad, close, cuts):
    text = f"{words}{ws}<tool_call>{bad}" + ("</tool_call>" + ws + words if close else "")
    bodies = streamed("hermes", split_at(text, cuts))
    assert collect(bodies) == whole("hermes", text) == ((text or None), [])


@settings(max_examples=60, deadline=None)
@given(args=st.dictionaries(st.text(max_size=4), st.one_of(
           st.integers(), st.floats(allow_nan=False, allow_infinity=False),
           st.text(max_size=6), st.booleans(), st.none(),
           st.lists(st.integers(), max_size=3)), max_size=4),
       separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]),
       ascii_=st.booleans(), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_generated_arguments_stream_as_json_dumps_of_the_parsed_value(
        args, separators, ascii_, cuts):
    raw = json.dumps(args, separators=separators, ensure_ascii=ascii_)
    text = f'<tool_call>{{"name": "fn", "arguments": {raw}}}</tool_call>'
    content, calls = collect(streamed("hermes", split_at(text, cuts)))
    assert content is None
    assert calls[0]["function"]["arguments"] == json.dumps(args, ensure_ascii=False)


@pytest.mark.parametrize("kind,text,kept", [
    ("required", '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"city": "Os',
     ["a"]),
    ("required", '[{"name": "a", "parameters": {"n": 1}}, {"name": "b"', ["a"]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>'
               '{"name": "b", "arguments": {"city": "Oslo", "', ["a"]),
    ("llama3_json", '{"name": "a", "parameters": {"x": [1, ', []),
    ("named", '{"city": "Os', []),
])
def test_a_cut_call_is_never_returned_and_is_named_in_parser_cut(kind, text, kept):
    parser = make(kind)
    content, calls = parse_all(parser, text)
    assert [c["function"]["name"] for c in calls] == kept
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
    assert [c["index"] for c in parser.cut] == [len(kept)]
    assert parser.num_complete == len(kept)
    assert collect(streamed(kind, list(text)))[1] == calls  # the stream, honouring the cut


@pytest.mark.parametrize("kind, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>'
               '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {"a" 1}, "name": "f"}</tool_call>'
               '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1]}; '
                    '{"name": "f", "parameters": {"a": 2}}'),
])
def test_balanced_but_invalid_arguments_are_cut_not_returned(kind, text):
    # brackets balance by depth but the JSON is broken: never a call whose
    # arguments do not parse, and the stream names it (every split point)
    content, calls = whole(kind, text)
    assert [c["function"]["arguments"] for c in calls] == ['{"a": 2}']
    for at in range(1, len(text)):
        parser = make(kind)
        parser.feed(text[:at])
        parser.feed(text[at:])
        parser.finish()
        assert [c["index"] for c in parser.cut] == [0], at
