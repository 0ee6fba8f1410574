"""Structured outputs and tool calling over HTTP against the real stack (the tiny
random-weight model: whatever it would say, the grammar decides what it may say,
so every reply must match), with the `openai` client and plain HTTP: each request
shape is honoured, stream = non-stream, the tool-call shapes and finish reasons,
every 400 queues nothing, and the counters, log line and span attributes."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.integration.conftest import TINY_FLAGS

TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 120}
MODEL = "test-tiny-llama-v1"  # tests/integration/tiny_model.py


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    from tests.integration.conftest import start_stack
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("structured-http"),
                        flags=[*TINY_FLAGS, *TOOL_FLAGS])
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.http_url + path, json={"max_tokens": 8, **body}, timeout=120)


def streamed_chat(client, **body):
    """(content or None, tool_calls as dicts, finish_reason, chunks) of a stream."""
    content, calls, finish, chunks = [], {}, None, []
    for chunk in client.chat.completions.create(stream=True, **body):
        chunks.append(chunk)
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            content.append(delta.content)
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": tc.id, "type": tc.type,
                                               "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += tc.function.name or ""
            call["function"]["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish, chunks


def calls_of(message) -> list[dict]:
    return [{"id": c.id, "type": c.type,
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls or ()]


def without_ids(calls):
    return [{**c, "id": None} for c in calls]


# ---- structured outputs: every shape, both endpoints, streamed or not


def test_response_format_json_schema_validates_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                  "schema": SCHEMA}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt,
                                           **GREEDY)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"  # the grammar ended it
    stream = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt,
                                            stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text
    completion = client.completions.create(model=MODEL, prompt="A person:", seed=3,
                                           extra_body={"response_format": fmt},
                                           temperature=1.0, max_tokens=120)
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


def test_response_format_json_object_is_an_object(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, temperature=0.0,
        max_tokens=60, extra_body={"ignore_eos": False})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # an object may be cut by max_tokens: then a prefix
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.lstrip().startswith("{")


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
     lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
     lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"grammar": 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'}},
     lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    ({"guided_grammar": 'start: "a" "b"+'}, lambda t: re.fullmatch("ab+", t)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     lambda t: not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", t))
     and jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_json": json.dumps(SCHEMA)},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"json_object": True}}, lambda t: t.lstrip().startswith("{")),
])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_s_fields_and_the_removed_ones_are_honoured(client, extra, check, endpoint):
    if endpoint == "completions":
        reply = client.completions.create(model=MODEL, prompt="Say:", extra_body=extra,
                                          **{**GREEDY, "max_tokens": 40})
        text = reply.choices[0].text
    else:
        reply = client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra,
                                               **{**GREEDY, "max_tokens": 40})
        text = reply.choices[0].message.content
    assert check(text), text


def test_a_constrained_request_is_counted_logged_and_traced(stack, client):
    client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                              extra_body={"structured_outputs": {"choice": ["p", "q"]}})
    metrics = httpx.get(stack.http_url + "/metrics", timeout=30).text
    assert re.search(r'gapserve:structured_output_requests_total\{[^}]*kind="choice"[^}]*'
                     r'source="structured_outputs"[^}]*\} [1-9]', metrics)
    text = "".join(p.read_text(errors="replace") for p in stack.log_dir.glob("frontend*.log"))
    assert '"constrained request"' in text and '"structured_output": "choice"' in text


# ---- bad input: a 400 naming the field, and nothing queued


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "strng"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(", "json": {}}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}},
     "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "start: nowhere"}, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_decoding_backend": "xgrammar",
                         "guided_json": {}}, "guided_decoding_backend"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required"}, "tool_choice"),
])
def test_bad_structured_input_is_a_400_and_queues_nothing(stack, path, body, param):
    before = stack.engine_status()
    reply = post(stack, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    after = stack.engine_status()
    assert after.num_waiting == 0 and after.num_running == 0
    assert after.num_free_blocks == before.num_free_blocks


# ---- tool calling


def test_tool_choice_required_calls_validate_and_finish_with_tool_calls(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                               tool_choice="required", temperature=1.0,
                                               seed=seed, max_tokens=120)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(call.function.arguments),
                                schemas[call.function.name])


def test_parallel_tool_calls_false_gives_at_most_one_call(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        assert len(reply.choices[0].message.tool_calls) == 1


def test_a_named_tool_choice_calls_that_function_and_finishes_with_stop(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                           tool_choice=named, **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_arrive_as_openai_sends_them_and_equal_the_reply(client, tool_choice):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, CLOCK],
            "tool_choice": tool_choice, **GREEDY}
    reply = client.chat.completions.create(**body).choices[0]
    content, calls, finish, chunks = streamed_chat(client, **body)
    assert (content, without_ids(calls), finish) == \
        (reply.message.content, without_ids(calls_of(reply.message)), reply.finish_reason)
    first = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    opening = first[0]
    assert opening.id and opening.type == "function" and opening.function.name
    assert opening.function.arguments == ""
    assert all(tc.id is None and tc.function.name is None for tc in first[1:]
               if tc.index == opening.index)


def test_tool_choice_none_and_auto_answer_in_content(client):
    for choice in ("none", "auto"):  # auto: the tiny model writes no <tool_call> tags
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                               tool_choice=choice, max_tokens=8,
                                               temperature=0.0)
        assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "length"


def test_tool_choice_without_tools_is_vllm_s_400(stack):
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        reply = post(stack, "/v1/chat/completions", {"messages": ASK, "tool_choice": choice})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "tool_choice" and error["type"] == "invalid_request_error"
        assert error["message"] == "When using `tool_choice`, `tools` must be set."
    reply = post(stack, "/v1/chat/completions", {"messages": ASK, "tools": [],
                                                 "tool_choice": "required"})
    assert reply.status_code == 200 and not reply.json()["choices"][0]["message"].get(
        "tool_calls")  # OpenAI's and vLLM's rule: required with no tools is none


def test_auto_replies_finish_name_re_serialize_and_fall_back_as_vllm_does(client):
    """A regex holds the tiny model to a hermes call written without spaces, then a
    tail far longer than max_tokens allows (each token is at least one character, so
    the call fits and the tail cannot end): finish_reason tool_calls although the
    reply was cut (vLLM's serving_chat), arguments json.dumps'd, streamed = not; a
    broken block is content with every character the model wrote."""
    call = '<tool_call>{"name":"get_time","arguments":{"zone":"utc"}}</tool_call>'
    cases = [(re.escape(call) + "[a-z]{400}", len(call) + 4),
             (r"Hi \n<tool_call>oops</tool_call> [a-z]{2}", 60)]
    for regex, max_tokens in cases:
        body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, CLOCK],
                "temperature": 0.0, "max_tokens": max_tokens,
                "extra_body": {"guided_regex": regex}}
        reply = client.chat.completions.create(**body).choices[0]
        content, calls, finish, _ = streamed_chat(client, **body)
        assert (content, without_ids(calls), finish) == (
            reply.message.content, without_ids(calls_of(reply.message)), reply.finish_reason)
        if regex.startswith("Hi"):
            assert not calls and finish == "stop"
            assert re.fullmatch(r"Hi \n<tool_call>oops</tool_call> [a-z]{2}", content)
        else:
            assert finish == "tool_calls"  # cut by max_tokens, yet it holds a call
            assert [c["function"] for c in calls] == [
                {"name": "get_time", "arguments": '{"zone": "utc"}'}]
            assert re.fullmatch("[a-z]+", content)  # the cut tail, after the call


def test_tool_history_goes_through_the_template(stack):
    history = [*ASK, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"}]
    reply = post(stack, "/v1/chat/completions", {"messages": history, "tools": [WEATHER]})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]["prompt_tokens"]
    bare = post(stack, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER]})
    assert usage > bare.json()["usage"]["prompt_tokens"] + 20  # the call and its result count
    metrics = httpx.get(stack.http_url + "/metrics", timeout=30).text
    assert re.search(r'gapserve:tool_choice_requests_total\{[^}]*tool_choice="auto"', metrics)


def test_chat_template_flag_and_the_llama3_json_parser(tiny_model_dir, start_stack_factory,
                                                       tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                        "{% if tools %}[tools]{{ tools | length }}{% endif %}[assistant]")
    stack = start_stack_factory(tiny_model_dir, flags=[
        *TINY_FLAGS, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
        "--chat-template", str(template), "--trust-request-chat-template"])
    expected = "[user]Weather in Paris, and the time?[tools]2[assistant]"
    ids = httpx.post(stack.http_url + "/tokenize", timeout=60,
                     json={"prompt": expected, "add_special_tokens": False}).json()
    call = r'\{"name": "get_time", "parameters": \{"zone": "(utc|cet)"\}\}'
    body = {"messages": ASK, "tools": [WEATHER, CLOCK], "max_tokens": 60,
            "temperature": 0.0, "guided_regex": call}
    reply = post(stack, "/v1/chat/completions", body).json()
    assert reply["usage"]["prompt_tokens"] == ids["count"]  # rendered by --chat-template
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [made] = choice["message"]["tool_calls"]
    assert made["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(made["function"]["arguments"]),
                        CLOCK["function"]["parameters"])
    # trusted, a request's own template (and its kwargs) replaces --chat-template's
    own = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{{ tail }}"
    reply = post(stack, "/v1/chat/completions", {"messages": ASK, "chat_template": own,
                                                 "chat_template_kwargs": {"tail": "[go]"}})
    ids = httpx.post(stack.http_url + "/tokenize", timeout=60, json={
        "prompt": "<Weather in Paris, and the time?>[go]", "add_special_tokens": False}).json()
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == ids["count"]
    # /tokenize renders a chat exactly as the chat completion does: the same template,
    # tools, request template and kwargs (vLLM's tokenize fields), token strings on request
    chat = httpx.post(stack.http_url + "/tokenize", timeout=60, json={
        "messages": ASK, "chat_template": own, "chat_template_kwargs": {"tail": "[go]"},
        "return_token_strs": True}).json()
    assert chat["tokens"] == ids["tokens"] and len(chat["token_strs"]) == chat["count"]
    with_tools = httpx.post(stack.http_url + "/tokenize", timeout=60, json={
        "messages": ASK, "tools": [WEATHER, CLOCK]}).json()
    rendered = httpx.post(stack.http_url + "/tokenize", timeout=60,
                          json={"prompt": expected, "add_special_tokens": False}).json()
    assert with_tools["tokens"] == rendered["tokens"]
    refused = httpx.post(stack.http_url + "/tokenize", timeout=60,
                         json={"prompt": "x", "tools": [WEATHER]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_each_of_n_streamed_choices_gets_its_own_calls(client):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, CLOCK], "n": 2,
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0,
            "seed": 4, "max_tokens": 120}
    replies = client.chat.completions.create(**body).choices
    calls: dict[int, dict] = {}
    finishes = {}
    for chunk in client.chat.completions.create(stream=True, **body):
        choice = chunk.choices[0]
        finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
        for tc in choice.delta.tool_calls or ():
            call = calls.setdefault(choice.index, {"name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
    for reply in replies:  # seeded: each stream equals its choice of the reply
        [made] = reply.message.tool_calls
        assert calls[reply.index] == {"name": made.function.name,
                                      "arguments": made.function.arguments}
        assert finishes[reply.index] == reply.finish_reason == "tool_calls"
