"""/v1/messages with the real `anthropic` SDK against the real default model
behind the real services (auto tool choice on): messages.create and
messages.stream agree, system and stop_sequences map to their stop_reason, tools
round-trip tool_use -> tool_result, max_tokens cuts are max_tokens, errors come
in Anthropic's shape, count_tokens counts the prompt the reply used."""

from __future__ import annotations

import json

import anthropic
import pydantic
import pytest

pytestmark = pytest.mark.e2e

# the SDK has no sampling arguments; the API takes them (docs/api.md)
GREEDY = {"extra_body": {"temperature": 0}}

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def client(agent_stack):
    return anthropic.Anthropic(base_url=agent_stack.http_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(agent_stack):
    return agent_stack.served_model_name


def same(streamed, reply) -> None:
    """The stream's final message equals the non-streamed one but for the ids (fresh
    per request: the message's and each tool_use block's)."""
    def shape(message):
        body = message.model_dump(exclude={"id"})
        for block in body["content"]:
            block.pop("id", None)
        return body
    assert shape(streamed) == shape(reply)


def test_create_and_stream_give_the_same_message(client, model):
    kwargs = dict(model=model, max_tokens=24, **GREEDY, system="Answer briefly.",
                  messages=[{"role": "user", "content": "What is the capital of France?"}])
    reply = client.messages.create(**kwargs)
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.input_tokens > 0 and 0 < reply.usage.output_tokens <= 24
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop",
            "message_delta"} <= set(kinds)
    same(final, reply)
    count = client.messages.count_tokens(model=model, system=kwargs["system"],
                                         messages=kwargs["messages"])
    assert count.input_tokens == reply.usage.input_tokens


def test_stop_reasons_map_from_the_finish(client, model):
    ask = [{"role": "user", "content": [{"type": "text", "text": "Count from 1 to 20."}]}]
    cut = client.messages.create(model=model, max_tokens=5, **GREEDY, messages=ask)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 5
    text = client.messages.create(model=model, max_tokens=60, **GREEDY,
                                  messages=ask).content[0].text
    word = text.split()[1] if len(text.split()) > 1 else text[:2]
    stopped = client.messages.create(model=model, max_tokens=60, **GREEDY,
                                     messages=ask, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word


def test_a_tool_round_trip_through_tool_use_and_tool_result(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=model, max_tokens=128, **GREEDY, tools=[WEATHER])
    reply = client.messages.create(messages=messages, tool_choice={"type": "any"}, **kwargs)
    assert reply.stop_reason == "tool_use"
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    with client.messages.stream(messages=messages, tool_choice={"type": "any"}, **kwargs) as s:
        same(s.get_final_message(), reply)
    messages += [{"role": "assistant", "content": reply.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                               "content": '{"sky": "sunny"}'} for u in uses]}]
    final = client.messages.create(messages=messages, tool_choice={"type": "none"}, **kwargs)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.content and final.content[0].type == "text"
    named = client.messages.create(messages=messages[:1], **kwargs, tool_choice={
        "type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]


def test_a_tool_call_cut_by_max_tokens_is_never_sent(client, model):
    kwargs = dict(model=model, max_tokens=12, **GREEDY, tools=[WEATHER],
                  tool_choice={"type": "any"},
                  messages=[{"role": "user", "content": "Weather in Oslo, Paris, Rome?"}])
    reply = client.messages.create(**kwargs)
    assert reply.stop_reason == "max_tokens"
    for block in reply.content:
        assert block.type == "tool_use" and isinstance(block.input, dict)
    with client.messages.stream(**kwargs) as stream:
        same(stream.get_final_message(), reply)


def test_errors_come_in_anthropic_s_shape(client, model):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8,
                               messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(model=model, max_tokens=8, thinking={
            "type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "hi"}])


class City(pydantic.BaseModel):  # sends no additionalProperties: strict all the same
    name: str
    country: str


def test_structured_outputs_parse_into_the_model_streamed_or_not(client, model):
    ask = [{"role": "user", "content": "Describe Paris."}]
    parsed = client.messages.parse(model=model, max_tokens=200, **GREEDY, messages=ask,
                                   output_format=City)  # sends output_config.format
    assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, City)
    kwargs = dict(model=model, max_tokens=200, **GREEDY, messages=ask, output_config={
        "format": {"type": "json_schema", "schema": City.model_json_schema()}})
    reply = client.messages.create(**kwargs)
    assert set(json.loads(reply.content[0].text)) == {"name", "country"}
    with client.messages.stream(**kwargs) as stream:
        same(stream.get_final_message(), reply)
    with pytest.raises(anthropic.BadRequestError, match="effort"):
        client.messages.create(model=model, max_tokens=8, messages=ask,
                               output_config={"effort": "high"})
