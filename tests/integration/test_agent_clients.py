"""What agent frameworks send, with their real clients against the real default
model (SmolLM2-135M-Instruct) behind the real services started with
--enable-auto-tool-choice --tool-call-parser hermes: strict schemas through the
`openai` client's parse and LangChain's with_structured_output (exactly the
declared keys, finish_reason stop), cut tool calls never returned (non-streamed
dropped, streamed named in the final chunk), parallel_tool_calls false as one
call, and the README's agent loop run as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pydantic
import pytest

from tests.integration.cut_search import cut_by_max_tokens

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[2] / "README.md"
ASK = [{"role": "user", "content": "What is the weather in Oslo, Paris and Rome?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # no additionalProperties, as clients send


class City(pydantic.BaseModel):  # sends no additionalProperties
    name: str
    country: str


@pytest.fixture(scope="module")
def stack(agent_stack):
    return agent_stack


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


def test_a_pydantic_schema_without_additional_properties_gets_exactly_its_keys(client, stack):
    schema = City.model_json_schema()
    assert "additionalProperties" not in schema
    kwargs = dict(model=stack.served_model_name, max_tokens=200, temperature=0,
                  messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "City", "schema": schema}})
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert set(json.loads(choice.message.content)) == {"name", "country"}
    City.model_validate_json(choice.message.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == choice.message.content


def test_the_openai_parse_helper_gets_a_valid_model(client, stack):
    reply = client.chat.completions.parse(
        model=stack.served_model_name, max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": "Describe Rome as JSON."}], response_format=City)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, City)


def test_langchain_with_structured_output_gets_a_valid_model(stack):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=stack.http_url + "/v1", api_key="unused",
                     model=stack.served_model_name, temperature=0, max_tokens=200,
                     max_retries=0)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(City, method=method).invoke("Describe Oslo.")
        assert isinstance(out, City), method


def required(client, stack, **kwargs):
    return dict(model=stack.served_model_name, messages=ASK, tools=[WEATHER],
                tool_choice="required", temperature=0, **kwargs)


def test_a_call_cut_by_max_tokens_is_dropped_and_the_stream_names_it(client, stack):
    full = client.chat.completions.create(**required(client, stack, max_tokens=300))
    n = full.usage.completion_tokens
    # greedy: the same prefix for every max_tokens; the largest below n that ends
    # inside a call's arguments (not between calls) is the cut this test needs
    found = cut_by_max_tokens(lambda m: [
        c for c in client.chat.completions.create(
            stream=True, **required(client, stack, max_tokens=m)) if c.choices], n)
    assert found, "no max_tokens cut a call"
    max_tokens, chunks = found
    kwargs = required(client, stack, max_tokens=max_tokens)
    cut = chunks[-1].choices[0].model_extra["cut_tool_calls"]
    assert cut and cut[0]["name"] == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "length"
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    calls = choice.message.tool_calls or []
    for call in calls:
        assert isinstance(json.loads(call.function.arguments), dict)
    kept: dict[int, str] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            if d.index not in {x["index"] for x in cut}:
                kept[d.index] = kept.get(d.index, "") + (d.function.arguments or "")
    assert list(kept.values()) == [c.function.arguments for c in calls]


def test_parallel_tool_calls_false_gives_exactly_one_call(client, stack):
    reply = client.chat.completions.create(
        **required(client, stack, max_tokens=300), parallel_tool_calls=False)
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1 and reply.choices[0].finish_reason == "tool_calls"
    assert "city" in json.loads(calls[0].function.arguments)


def test_the_readme_agent_loop_runs_as_written(stack, capsys):
    code = re.search(r"```python agent-loop\n(.*?)```", README.read_text(), re.S).group(1)
    code = code.replace("http://127.0.0.1:8000/v1", stack.http_url + "/v1")
    scope: dict = {}
    exec(compile(code, "README agent loop", "exec"), scope)
    messages = scope["messages"]
    assert messages[1]["tool_calls"] and messages[2]["role"] == "tool"
    assert messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    assert scope["message"].content and capsys.readouterr().out.strip()
