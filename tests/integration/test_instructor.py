"""instructor (the structured-output library) with its real `from_openai` client
against the real default model behind the real services (auto tool choice on), in
the modes its users pick: TOOLS (a forced function call),
JSON (json_object plus the schema in the prompt), JSON_SCHEMA (response_format
json_schema), RESPONSES_TOOLS (/v1/responses with a forced call) and, through
`from_anthropic`, TOOLS (/v1/messages with a forced tool); and
create_partial, its streaming of a partly filled model. (Its Anthropic
JSON_SCHEMA mode needs an SDK whose messages.create takes `output_format`; with
the pinned anthropic 2.16 it falls back to a schema in the prompt, which a 135M
model does not follow: /v1/messages' output_config is tested with the SDK's own
messages.parse in test_messages_api.py.) instructor retries are
off: a reply that does not validate fails the test instead of being re-asked.

instructor 1.17.0 is installed with --no-deps (pyproject.toml [tool.gapserve.setup]
says why): create_partial is the code path that uses jiter, run here on the test
extra's jiter."""

from __future__ import annotations

import json

import instructor
import pydantic
import pytest

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "Describe Paris."}]


class City(pydantic.BaseModel):  # sends no additionalProperties, as instructor does
    name: str
    country: str


@pytest.fixture(scope="module")
def stack(agent_stack):
    return agent_stack


def create(stack, mode, **kwargs):
    client = instructor.from_openai(stack.openai(), mode=mode)
    return client.chat.completions.create_with_completion(
        model=stack.served_model_name, response_model=City, messages=ASK, max_retries=0,
        max_tokens=200, temperature=0, **kwargs)


def test_tools_mode_validates_a_forced_call(stack):
    city, completion = create(stack, instructor.Mode.TOOLS)
    assert isinstance(city, City)
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "City"
    # the call's grammar is the strict schema: exactly the declared keys
    assert set(json.loads(call.function.arguments)) == {"name", "country"}


def test_json_schema_mode_validates_exactly_the_declared_keys(stack):
    city, completion = create(stack, instructor.Mode.JSON_SCHEMA)
    assert isinstance(city, City)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert set(json.loads(choice.message.content)) == {"name", "country"}


def test_json_mode_validates(stack):
    # json_object: any JSON object (the schema is only in the prompt), so undeclared
    # keys may come too; City ignores them, as pydantic models do by default
    city, completion = create(stack, instructor.Mode.JSON)
    assert isinstance(city, City)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_responses_tools_validates_through_v1_responses(stack):
    city, response = create(stack, instructor.Mode.RESPONSES_TOOLS)
    assert isinstance(city, City)
    assert response.object == "response" and response.status == "completed"
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "City"
    assert set(json.loads(call.arguments)) == {"name", "country"}


def test_create_partial_streams_up_to_the_model_create_returns(stack):
    client = instructor.from_openai(stack.openai(), mode=instructor.Mode.JSON_SCHEMA)
    kwargs = dict(model=stack.served_model_name, response_model=City, messages=ASK,
                  max_retries=0, max_tokens=200, temperature=0)
    partials = list(client.chat.completions.create_partial(**kwargs))
    assert len(partials) > 1  # streamed: jiter parsed incomplete JSON on the way
    assert partials[0].name is None or len(partials[0].name) <= len(partials[-1].name)
    whole = client.chat.completions.create(**kwargs)
    assert isinstance(whole, City)
    assert partials[-1].model_dump() == whole.model_dump()


def test_from_anthropic_tools_validates_through_v1_messages(stack):
    import anthropic
    sdk = anthropic.Anthropic(base_url=stack.http_url, api_key="unused", max_retries=0)
    client = instructor.from_anthropic(sdk, mode=instructor.Mode.TOOLS)
    city, message = client.messages.create_with_completion(
        model=stack.served_model_name, response_model=City, messages=ASK, max_retries=0,
        max_tokens=200, extra_body={"temperature": 0})  # the SDK takes no temperature
    assert isinstance(city, City)
    assert message.stop_reason == "tool_use"
    [block] = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "City" and set(block.input) == {"name", "country"}
