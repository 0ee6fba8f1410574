"""/v1/responses without a network: a Responses request becomes the chat request
the chat path runs, refused fields are named, output items and stream events
fold the same delta bodies, and the store is bounded in entries and age."""

from __future__ import annotations

import pytest

from frontend_svc.api.responses_format import ResponseOutput
from frontend_svc.api.responses_protocol import (
    ResponsesRequest, chat_request, check_responses_refused)
from frontend_svc.api.responses_store import ResponseStore
from frontend_svc.errors import FieldError

TOOL = {"type": "function", "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def translated(**body):
    req = ResponsesRequest(**body)
    check_responses_refused(req)
    return chat_request(req, [])


def test_a_string_input_and_instructions_become_system_and_user_messages():
    chat = translated(input="Hi", instructions="Be brief.", max_output_tokens=7,
                      temperature=0.0, top_k=3)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."),
                                                           ("user", "Hi")]
    assert chat.max_tokens == 7 and chat.temperature == 0.0 and chat.top_k == 3


def test_function_calls_and_their_outputs_become_one_assistant_turn_and_tool_messages():
    chat = translated(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city":"Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"}],
        tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in chat.messages[1].tool_calls] == ["c1", "c2"]
    assert chat.messages[2].tool_call_id == "c1" and chat.messages[3].content == "rain"
    assert chat.tools == [{"type": "function", "function": {
        k: TOOL[k] for k in ("name", "description", "parameters")}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"},
                                             "strict": True}})])
def test_text_format_becomes_the_chat_response_format(fmt, expected):
    assert translated(input="x", text={"format": fmt}).response_format == expected


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_call_leaves_text_format_nothing_to_shape(choice):
    # instructor's RESPONSES_TOOLS sends both: the call follows its tool's schema
    fmt = {"type": "json_schema", "name": "w", "schema": TOOL["parameters"]}
    chat = translated(input="x", tools=[TOOL], tool_choice=choice, text={"format": fmt})
    assert chat.response_format is None and chat.tool_choice is not None
    auto = translated(input="x", tools=[TOOL], tool_choice="auto", text={"format": fmt})
    assert auto.response_format is not None


@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]},
     "include.1"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without the include it would do nothing
    ({"truncation": "auto"}, "truncation"),
    ({"n": 2}, "n"),
    ({"suffix": "x"}, "suffix"),  # the chat route's table applies too
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input.0.content.0"),
])
def test_unsupported_fields_are_refused_by_name(body, param):
    body.setdefault("input", "x")
    with pytest.raises(FieldError) as err:
        translated(**body)
    assert err.value.param == param


def test_the_logprobs_include_is_chat_s_logprobs_with_top_logprobs():
    chat = translated(input="x", include=["message.output_text.logprobs"], top_logprobs=3)
    assert chat.logprobs is True and chat.top_logprobs == 3
    chat = translated(input="x", include=["message.output_text.logprobs"])
    assert chat.logprobs is True and chat.top_logprobs == 0
    assert not translated(input="x", top_logprobs=0).logprobs


def test_logprobs_go_to_the_text_deltas_and_a_held_back_token_s_to_the_next():
    lp = [{"token": t, "logprob": -1.0, "bytes": list(t.encode()), "top_logprobs": []}
          for t in ("He", "llo", "\ufffd", "!", "</s>")]
    streamed = ResponseOutput()
    events = streamed.feed([{"content": "He"}], lp[:1]) + \
        streamed.feed([{"content": "llo"}], lp[1:2]) + \
        streamed.feed([], lp[2:3]) + streamed.feed([{"content": "é!"}], lp[3:4]) + \
        streamed.feed([], lp[4:]) + streamed.close()
    deltas = [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [lp[:1], lp[1:2], lp[2:4]]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == lp
    whole = ResponseOutput()
    whole.feed([{"content": "Hello" + "é!"}], lp)
    whole.close()
    strip = [{k: v for k, v in item.items() if k != "id"} for item in whole.items]
    assert strip == [{k: v for k, v in item.items() if k != "id"} for item in streamed.items]
    assert whole.items[0]["content"][0]["logprobs"] == lp


def test_reasoning_and_labels_are_accepted_with_no_effect():
    chat = translated(input="x", reasoning={"effort": "low"}, metadata={"a": "b"},
                      user="u", store=False)
    assert [m.content for m in chat.messages] == ["x"]


def test_text_then_calls_open_one_item_each_and_close_each_once():
    out = ResponseOutput()
    events = out.feed([{"content": "Let me check."},
                       {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                        "function": {"name": "f", "arguments": "{\"a\""}}]},
                       {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}])
    events += out.close()
    types = [e["type"] for e in events]
    assert types == ["response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     # a call goes out whole, once complete: one delta
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done"]
    assert [i["type"] for i in out.items] == ["message", "function_call"]
    assert out.items[1]["arguments"] == '{"a": 1}' and out.items[1]["call_id"] == "call_a"
    assert out.tool_calls == [{"id": "call_a", "type": "function",
                               "function": {"name": "f", "arguments": '{"a": 1}'}}]


def test_a_cut_call_is_never_sent_streamed_or_not():
    from frontend_svc.structured.tool_parsers import HermesParser
    cut_reply = ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
                 '<tool_call>{"name": "f", "arguments": {"a": 2')  # max_tokens cut it
    parser = HermesParser()
    whole = ResponseOutput(parser.cut)
    whole.feed(parser.feed(cut_reply) + parser.finish())
    whole.close("incomplete")
    parser = HermesParser()
    streamed = ResponseOutput(parser.cut)
    events = []
    for ch in cut_reply:
        events += streamed.feed(parser.feed(ch))
    events += streamed.feed(parser.finish()) + streamed.close("incomplete")
    for out in (whole, streamed):
        assert [(i["name"], i["arguments"]) for i in out.items] == [("f", '{"a": 1}')]
    sent = [e for e in events if e["type"] == "response.output_item.added"]
    assert len(sent) == 1 and len(parser.cut) == 1


def test_the_store_evicts_the_oldest_beyond_its_size_and_expires_by_age():
    now = [0.0]
    store = ResponseStore(max_entries=2, max_age_s=10, clock=lambda: now[0])
    for k in range(3):
        store.put(f"r{k}", {"id": f"r{k}"}, [])
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    now[0] = 10.0
    assert store.get("r1") is None and store.get("r2") is None and len(store) == 0
    store.put("r3", {}, [])
    assert store.delete("r3") and not store.delete("r3")


def test_every_field_of_the_openai_client_s_responses_create_is_honoured_refused_or_inert():
    from openai.types.responses import response_create_params as params

    from frontend_svc.api.protocol import REFUSED
    from frontend_svc.api.responses_protocol import (
        PASSED_FIELDS, RESPONSES_NO_EFFECT, RESPONSES_REFUSED)
    sent = set(params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    known = (set(ResponsesRequest.model_fields) | set(RESPONSES_REFUSED) | set(REFUSED)
             | RESPONSES_NO_EFFECT | set(PASSED_FIELDS))
    assert sent - known == set()
