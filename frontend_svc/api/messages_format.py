"""Anthropic's Messages API <-> the chat request path: a /v1/messages body becomes a
ChatCompletionRequest (so the chat template, tools, grammar, parsers, admission and
metrics are chat's), and a finished chat choice becomes a Messages reply; the
streaming events are built from the same tool-parser bodies as chat's chunks.

Field by field: docs/api.md (/v1/messages)."""

from __future__ import annotations

import json
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from frontend_svc.api.protocol import ChatCompletionRequest
from frontend_svc.errors import FieldError

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
# fields of Anthropic's API that change generation and are not served here: refused
REFUSED = {"thinking": "extended thinking needs a reasoning model",
           "container": "code execution containers are not served",
           "mcp_servers": "MCP servers are not served",
           "context_management": "context management is not served"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt option would change the reply

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # inert: Anthropic's user_id for abuse tracking
    service_tier: str | None = None  # inert: one tier here
    cache_control: dict[str, Any] | None = None  # inert: the prefix cache is automatic
    # Anthropic's structured outputs: output_config.format (GA) or output_format (the
    # structured-outputs-2025-11-13 beta, what instructor's JSON_SCHEMA mode sends)
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    thinking: Any = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text(blocks: Union[str, list[dict[str, Any]], None], param: str) -> str:
    """A string, or text blocks joined (Anthropic's system and tool_result content)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or \
                not isinstance(block.get("text"), str):
            raise FieldError(f"{param}.{i}: only text blocks are supported here; got "
                             f"{block.get('type') if isinstance(block, dict) else block!r}",
                             f"{param}.{i}")
        parts.append(block["text"])
    return "\n".join(parts)


def _messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _text(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        role, content = msg.get("role"), msg.get("content")
        if role not in ("user", "assistant"):
            raise FieldError(f"messages.{i}.role must be user or assistant; got {role!r}",
                             f"messages.{i}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise FieldError(f"messages.{i}.content must be a string or a list of blocks",
                             f"messages.{i}.content")
        text, calls = [], []
        for j, block in enumerate(content):
            param = f"messages.{i}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(_text([block], param))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(result, f"{param}.content")})
            else:
                raise FieldError(f"{param}: a {kind!r} block is not supported in a {role} "
                                 "message (text, tool_use from the assistant, tool_result "
                                 "from the user)", f"{param}.type")
        if text or calls:
            turn: dict[str, Any] = {"role": role, "content": "".join(text) if text else None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def _tools(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """tools and tool_choice in chat's terms (auto, any -> required, tool -> named, none)."""
    out: dict[str, Any] = {}
    if req.tools is not None:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") not in (None, "custom") or "name" not in tool:
                raise FieldError(f"tools.{i}: only client tools (name, description, "
                                 f"input_schema) are supported; got {tool.get('type')!r}",
                                 f"tools.{i}")
            fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
            if tool.get("description"):
                fn["description"] = tool["description"]
            tools.append({"type": "function", "function": fn})
        out["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind == "any":
            out["tool_choice"] = "required"
        elif kind == "none":
            out["tool_choice"] = "none"
        elif kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        else:
            raise FieldError("tool_choice.type must be auto, any, tool or none; got "
                             f"{kind!r}", "tool_choice.type")
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def _response_format(req: MessagesRequest) -> dict[str, Any] | None:
    """Anthropic's structured outputs as chat's response_format json_schema (strict:
    docs/structured_outputs.md): the reply's text is the schema's JSON."""
    config = req.output_config or {}
    for key, value in config.items():
        if key != "format" and value is not None:
            raise FieldError(f"output_config.{key} is not supported (only format: "
                             f"effort needs a reasoning model)", f"output_config.{key}")
    if req.output_format is not None and config.get("format") is not None:
        raise FieldError("send output_config.format or output_format, not both",
                         "output_format")
    fmt = req.output_format if req.output_format is not None else config.get("format")
    if fmt is None:
        return None
    param = "output_format" if req.output_format is not None else "output_config.format"
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict):
        raise FieldError(f"{param}: only {{\"type\": \"json_schema\", \"schema\": "
                         "{...}} is supported", param)
    return {"type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    for name, why in REFUSED.items():
        if getattr(req, name) is not None:
            raise FieldError(f"{name} is not supported: {why}", name)
    fields: dict[str, Any] = {"messages": _messages(req), "max_tokens": req.max_tokens,
                              "stream": req.stream, **_tools(req)}
    response_format = _response_format(req)
    if response_format is not None:
        fields["response_format"] = response_format
    for name, value in (("stop", req.stop_sequences), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("top_k", req.top_k)):
        if value is not None:
            fields[name] = value
    if req.temperature is None:
        fields["temperature"] = 1.0  # Anthropic's default
    return ChatCompletionRequest(**fields)


def count_request(req: CountTokensRequest) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=_messages(req), **_tools(req))


def stop_reason(finish: str | None, stop: str | int | None, num_calls: int
                ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from chat's finish: a matched stop string is
    stop_sequence, complete tool calls are tool_use, a cut reply is max_tokens."""
    if finish == "length":
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def message(resp_id: str, model: str, blocks: list[dict], reason: str | None,
            sequence: str | None, input_tokens: int, output_tokens: int) -> dict:
    return {"id": resp_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def event(kind: str, body: dict) -> str:
    """One server-sent event as Anthropic writes it: the type twice (event: and data)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


