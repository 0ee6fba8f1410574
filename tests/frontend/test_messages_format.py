"""Anthropic's Messages body -> chat's request, field by field, and chat's finish
-> Anthropic's stop_reason; unsupported blocks and fields are refused by name."""

from __future__ import annotations

import pytest

from frontend_svc.api import messages_format as mf
from frontend_svc.errors import FieldError


def chat(**body):
    body.setdefault("max_tokens", 16)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return mf.chat_request(mf.MessagesRequest(**body))


def test_system_blocks_and_messages_become_chat_turns():
    req = chat(system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
               messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                         {"role": "assistant", "content": "Hello"}],
               stop_sequences=["\n"], temperature=0.5, top_p=0.9, top_k=5)
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "Be\nbrief."), ("user", "Hi"), ("assistant", "Hello")]
    assert (req.stop, req.temperature, req.top_p, req.top_k, req.max_tokens) == \
        (["\n"], 0.5, 0.9, 5, 16)


def test_tool_use_and_tool_result_blocks_become_tool_calls_and_tool_turns():
    req = chat(tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
               tool_choice={"type": "any", "disable_parallel_tool_use": True},
               messages=[{"role": "user", "content": "go"},
                         {"role": "assistant", "content": [
                             {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}])
    assert req.tools == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "description": "d"}}]
    assert req.tool_choice == "required" and req.parallel_tool_calls is False
    assert req.messages[1].tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert (req.messages[2].role, req.messages[2].tool_call_id) == ("tool", "t1")


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}})])
def test_tool_choice_maps_to_chat_s(choice, expected):
    req = chat(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice=choice)
    assert req.tool_choice == expected


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
])
def test_unsupported_blocks_and_fields_are_refused_by_name(body, param):
    with pytest.raises(FieldError) as info:
        chat(**body)
    assert info.value.param == param


@pytest.mark.parametrize("finish,stop,calls,expected", [
    ("stop", None, 0, ("end_turn", None)), ("stop", 2, 0, ("end_turn", None)),
    ("stop", "END", 0, ("stop_sequence", "END")), ("stop", None, 1, ("tool_use", None)),
    ("length", None, 1, ("max_tokens", None)), ("length", None, 0, ("max_tokens", None))])
def test_stop_reason_follows_the_finish(finish, stop, calls, expected):
    assert mf.stop_reason(finish, stop, calls) == expected


def test_errors_have_anthropic_s_types():
    assert mf.error_body(400, "x") == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "x"}}
    assert mf.error_body(429, "x")["error"]["type"] == "rate_limit_error"
    assert mf.error_body(500, "x")["error"]["type"] == "api_error"


def test_a_streamed_call_broken_after_its_name_is_never_sent_even_before_the_last():
    import json

    from frontend_svc.api.messages_api import Blocks
    from frontend_svc.structured.tool_parsers import HermesParser, parse_all
    reply = ('<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>'
             '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>')
    parser = HermesParser()
    blocks = Blocks(parser.cut)
    events = []
    for ch in reply:
        for body in parser.feed(ch):
            events += blocks.add(body)
    for body in parser.finish():
        events += blocks.add(body)
    events += blocks.close()
    sent = [json.loads(e.split("data: ", 1)[1])["delta"]["partial_json"] for e in events
            if "input_json_delta" in e]
    assert sent == ['{"a": 2}'] and len(parser.cut) == 1
    _, calls = parse_all(HermesParser(), reply)  # the non-streamed reply agrees
    assert [c["function"]["arguments"] for c in calls] == sent


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize("body", [
    {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
    {"output_format": {"type": "json_schema", "schema": SCHEMA}},  # the beta's name
    {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA},
                       "effort": None}}])
def test_structured_outputs_become_chat_s_strict_json_schema(body):
    fmt = chat(**body).response_format
    fmt = fmt if isinstance(fmt, dict) else fmt.model_dump(exclude_none=True)
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == SCHEMA


@pytest.mark.parametrize("body, param", [
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"output_format": {"type": "json_schema"}}, "output_format"),
    ({"output_format": {"type": "json_schema", "schema": SCHEMA},
      "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
     "output_format")])
def test_structured_outputs_it_cannot_honour_are_refused_by_name(body, param):
    with pytest.raises(FieldError) as err:
        chat(**body)
    assert err.value.param == param
