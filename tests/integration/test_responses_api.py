"""/v1/responses, /version and /ping through the real clients against the real
stack on the default model (SmolLM2-135M-Instruct, hermes tool parser): the
`openai` client's responses.create / responses.stream (parsed into its types),
openai-agents' default model (the Responses API) in a full tool loop, and
LangChain's ChatOpenAI with use_responses_api."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.integration.cut_search import cut_by_max_tokens

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}}
GREEDY = {"temperature": 0.0, "max_output_tokens": 24}


@pytest.fixture(scope="module")
def stack(agent_stack):
    """The session's default-model stack with auto tool choice (hermes)."""
    return agent_stack


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai(timeout=600)


def test_version_and_ping_answer_as_vllm_does(stack):
    from importlib import metadata
    assert httpx.get(stack.http_url + "/version").json() == {
        "version": metadata.version("gapserve")}
    assert httpx.get(stack.http_url + "/ping").status_code == 200
    assert httpx.post(stack.http_url + "/ping").status_code == 200


def test_a_text_response_parses_and_counts_its_tokens(client, stack):
    resp = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.",
                                   **GREEDY)
    assert resp.object == "response" and resp.output_text
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Say hello."}],
        temperature=0.0, max_tokens=24)
    assert resp.output_text == chat.choices[0].message.content  # the same path, greedy
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                           else "completed")


def test_the_stream_sends_the_typed_events_and_ends_equal_to_the_non_streamed(client):
    whole = client.responses.create(model=MODEL, input="Count to five.", **GREEDY)
    with client.responses.stream(model=MODEL, input="Count to five.", **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    for expected in ("response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done"):
        assert expected in types
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_required_tool_call_streams_its_arguments_and_the_output_is_sent_back(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    common = {"model": MODEL, "tools": [WEATHER], "tool_choice": "required",
              "temperature": 0.0, "max_output_tokens": 60, "parallel_tool_calls": False}
    resp = client.responses.create(input=ask, **common)
    [call] = [o for o in resp.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    with client.responses.stream(input=ask, **common) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [streamed] = [o for o in final.output if o.type == "function_call"]
    assert args == done.arguments == streamed.arguments == call.arguments
    answer = client.responses.create(
        model=MODEL, input=[*ask, {"type": "function_call", "call_id": call.call_id,
                                   "name": call.name, "arguments": call.arguments},
                            {"type": "function_call_output", "call_id": call.call_id,
                             "output": "Sunny, 21 C"}],
        tools=[WEATHER], tool_choice="none", **GREEDY)
    assert answer.output_text and answer.usage.input_tokens > resp.usage.input_tokens


def test_a_call_cut_by_max_output_tokens_is_never_sent_streamed_or_not(client):
    ask = "What is the weather in Oslo, Paris and Rome?"
    tool = {**WEATHER, "parameters": {**WEATHER["parameters"], "properties": {
        "city": {"type": "string"}}}}  # no maxLength: a call long enough to cut
    chat = dict(model=MODEL, messages=[{"role": "user", "content": ask}], temperature=0.0,
                tools=[{"type": "function", "function": {
                    k: tool[k] for k in ("name", "description", "parameters")}}],
                tool_choice="required")
    n = client.chat.completions.create(max_tokens=300, **chat).usage.completion_tokens
    # greedy, and the same chat request underneath: the chat stream names the cut
    found = cut_by_max_tokens(lambda m: [c for c in client.chat.completions.create(
        stream=True, max_tokens=m, **chat) if c.choices], n)
    assert found, "no max_tokens cut a call"
    max_tokens, _ = found
    kept = client.chat.completions.create(max_tokens=max_tokens, **chat)
    kept = [c.function.arguments for c in kept.choices[0].message.tool_calls or []]
    common = dict(model=MODEL, input=ask, tools=[tool], tool_choice="required",
                  temperature=0.0, max_output_tokens=max_tokens)
    whole = client.responses.create(**common)
    with client.responses.stream(**common) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert whole.status == final.status == "incomplete"
    for resp in (whole, final):
        calls = [o.arguments for o in resp.output if o.type == "function_call"]
        assert calls == kept  # the cut one dropped; each kept one parses
        assert all(isinstance(json.loads(a), dict) for a in calls)
    sent = [e.item.call_id for e in events if e.type == "response.output_item.added"]
    assert len(sent) == len(kept)


def test_text_format_json_schema_constrains_the_reply(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    resp = client.responses.create(
        model=MODEL, input="Name a city in JSON.", temperature=0.0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}})
    assert set(json.loads(resp.output_text)) == {"city"}


def test_previous_response_id_continues_a_stored_conversation_and_delete_forgets_it(
        client, stack):
    first = client.responses.create(model=MODEL, input="My name is Ada.", **GREEDY)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, **GREEDY)
    alone = client.responses.create(model=MODEL, input="What is my name?", store=False,
                                    **GREEDY)
    # the second prompt holds the first exchange: more input tokens than the question alone
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    missing = httpx.get(f"{stack.http_url}/v1/responses/{alone.id}")
    assert missing.status_code == 404  # store=False: not kept
    client.responses.delete(first.id)
    reply = httpx.post(stack.http_url + "/v1/responses",
                       json={"model": MODEL, "input": "x", "previous_response_id": first.id})
    assert reply.status_code == 404 and "previous_response_id" in reply.text


def same_logprobs(got: list, expected: list) -> None:
    """The same tokens and top tokens; the values equal up to float noise (a request
    that finds its prompt in the prefix cache computes it in another order)."""
    def tokens(lps):
        return [(lp["token"], lp["bytes"], [t["token"] for t in lp["top_logprobs"]])
                for lp in lps]
    got = [lp.model_dump() for lp in got]
    assert tokens(got) == tokens(expected)
    for g, e in zip(got, expected):
        assert g["logprob"] == pytest.approx(e["logprob"], abs=1e-3)
        assert [t["logprob"] for t in g["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in e["top_logprobs"]], abs=1e-3)


def test_output_text_logprobs_are_chat_s_and_the_stream_carries_them(client):
    kwargs = dict(model=MODEL, input="Say hello.", include=["message.output_text.logprobs"],
                  top_logprobs=2, **GREEDY)
    whole = client.responses.create(**kwargs)
    part = whole.output[0].content[0]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], logprobs=True,
        top_logprobs=2, temperature=0.0, max_tokens=24)
    expected = [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    assert part.text == chat.choices[0].message.content
    same_logprobs(part.logprobs, expected)
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [lp for e in events if e.type == "response.output_text.delta"
              for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    same_logprobs(done.logprobs, expected)
    same_logprobs(deltas, expected[:len(deltas)])  # an end-of-text token may follow in done
    same_logprobs(final.output[0].content[0].logprobs, expected)
    plain = client.responses.create(model=MODEL, input="Say hello.", **GREEDY)
    assert plain.output[0].content[0].logprobs == []  # only when asked for


@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    # a tool call's tokens have no output_text to carry logprobs
    ({"include": ["message.output_text.logprobs"], "tools": [WEATHER]}, "include")])
def test_unsupported_fields_are_a_400_naming_them(stack, body, param):
    reply = httpx.post(stack.http_url + "/v1/responses",
                       json={"model": MODEL, "input": "x", **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_openai_agents_default_model_runs_a_tool_loop(stack):
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner,
                        ToolsToFinalOutputResult, function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    def after_two_rounds(_, results):
        # a 135M model under tool_choice auto calls the tool again rather than answer:
        # the loop ends after its second round, which the model made having been sent
        # the first round's function_call_output
        return ToolsToFinalOutputResult(is_final_output=len(calls) >= 2,
                                        final_output=results[-1].output)

    model = OpenAIResponsesModel(MODEL, AsyncOpenAI(base_url=stack.http_url + "/v1",
                                                    api_key="unused", max_retries=0))
    agent = Agent(name="weather", instructions="Answer with the weather.", model=model,
                  tools=[get_weather], tool_use_behavior=after_two_rounds,
                  model_settings=ModelSettings(tool_choice="required", temperature=0.0,
                                               max_tokens=60, parallel_tool_calls=False))
    # auto_previous_response_id: the second turn sends only the tool's output, chained
    # to the first response by previous_response_id (the server's store)
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                                    auto_previous_response_id=True))
    assert len(calls) == 2 and len(result.raw_responses) == 2
    assert result.final_output == f"Sunny in {calls[-1]}"
    assert [item.type for item in result.new_items] == [
        "tool_call_item", "tool_call_output_item"] * 2


def test_langchain_use_responses_api_parses_text_and_tool_calls(stack):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=stack.http_url + "/v1", api_key="unused",
                     use_responses_api=True, temperature=0.0, max_tokens=24, max_retries=0)
    reply = llm.invoke("Say hello.")
    assert reply.text and reply.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.text for chunk in llm.stream("Say hello."))
    assert streamed == reply.text
    tooled = llm.model_copy(update={"max_tokens": 60}).bind_tools(
        [WEATHER], tool_choice="required", parallel_tool_calls=False)
    [call] = tooled.invoke("What is the weather in Paris?").tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"], dict)
