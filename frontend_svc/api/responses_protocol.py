"""The Responses API's request (POST /v1/responses) and its translation into a
chat completion request: the route then runs exactly the chat path (template,
tools, structured outputs, tool parsers, admission, metrics, spans).

RESPONSES_REFUSED is the table of Responses fields refused with a 400 naming
them; RESPONSES_NO_EFFECT those accepted with no effect. docs/api.md mirrors both.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict

from frontend_svc.api.protocol import NO_EFFECT, REFUSED, ChatCompletionRequest, Refusal
from frontend_svc.errors import FieldError
from frontend_svc.request.caps import REJECTED
from frontend_svc.telemetry.observe import log

RESPONSES_REFUSED: dict[str, Refusal] = {
    "background": Refusal("background responses are not supported", bool),
    "conversation": Refusal("conversations are not supported: use previous_response_id"),
    "prompt": Refusal("prompt templates are not supported: send input and instructions"),
    "truncation": Refusal("only truncation \"disabled\" is supported: a prompt longer than "
                          "the model's context is a 400", lambda v: v not in (None, "disabled")),
    "max_tool_calls": Refusal("max_tool_calls is not supported: parallel_tool_calls false "
                              "allows one call"),
    "n": Refusal("a response has one output: n must be 1", lambda v: v not in (None, 1)),
    "context_management": Refusal("context_management is not supported", bool),
    "moderation": Refusal("moderation is not supported"),
    "image": Refusal("image generation is not supported"),
    "access_programs": Refusal("access_programs is not supported"),
    "background_options": Refusal("background responses are not supported"),
}
# Accepted with no effect: labels (metadata, user, safety_identifier), OpenAI's hosted
# caching hints, stream_options (obfuscation pads OpenAI's events; there is none here),
# and `reasoning`: vLLM ignores it for a model without a reasoning parser, as every
# model served here is (docs/api.md)
RESPONSES_NO_EFFECT = frozenset({"reasoning", "stream_options"}) | NO_EFFECT
# the one `include` served: each output_text part's per-token logprobs (vLLM's too);
# the others name extras of reasoning models and hosted tools, none served here
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# vLLM's extra sampling fields on /v1/responses, passed to the chat request unchanged
PASSED_FIELDS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "priority", "request_id", "cache_salt", "skip_special_tokens",
                 "include_stop_str_in_output", "logit_bias", "chat_template_kwargs")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked by check_responses_refused

    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    store: bool | None = True  # OpenAI's default: stored (bounded: responses_store.py)
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    priority: int = 0
    request_id: str | None = None


def check_responses_refused(req: ResponsesRequest) -> None:
    """A 400 naming the first refused field: the Responses table, then the chat
    route's (a chat-only field sent here is refused or ignored as there)."""
    extra = req.model_extra or {}
    for name, rule in (*RESPONSES_REFUSED.items(), *REFUSED.items()):
        if name in extra and rule.refuses(extra[name]):
            REJECTED.labels("unsupported_field").inc()
            raise FieldError(f"{name}: {rule.message}", name)
    for i, name in enumerate(req.include or ()):
        if name != OUTPUT_LOGPROBS:
            REJECTED.labels("unsupported_field").inc()
            raise FieldError(f"include.{i}: {name!r} is not supported (only "
                             f"{OUTPUT_LOGPROBS!r}: no reasoning or hosted-tool extras)",
                             f"include.{i}")
    if req.top_logprobs and not wants_logprobs(req):
        raise FieldError(f"top_logprobs requires include [{OUTPUT_LOGPROBS!r}]",
                         "top_logprobs")
    ignored = sorted(set(extra) - RESPONSES_NO_EFFECT - set(PASSED_FIELDS)
                     - set(RESPONSES_REFUSED) - set(REFUSED))
    if ignored:
        log.info("ignored unknown request fields", fields=ignored, route="/v1/responses")


def wants_logprobs(req: ResponsesRequest) -> bool:
    return OUTPUT_LOGPROBS in (req.include or ())


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's input items as chat messages (instructions not included: they
    are not carried over to a later response, OpenAI's rule)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict] = []
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise FieldError(f"{where}.role: {role!r} is not a message role (user, "
                                 "system, developer, assistant)", f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _required(item, "call_id", where), "type": "function",
                    "function": {"name": _required(item, "name", where),
                                 "arguments": _required(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _required(item, "call_id", where),
                             "content": _text_of(item.get("output"), where)})
        elif kind == "reasoning":
            continue  # a reasoning model's earlier thoughts: none are rendered here
        else:
            raise FieldError(f"{where}.type: input items of type {kind!r} are not supported "
                             "(message, function_call, function_call_output are)",
                             f"{where}.type")
    if not messages:
        raise FieldError("input has no message", "input")
    return messages


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat completion request that runs this response: `history` (the stored
    conversation of previous_response_id, possibly empty) plus this input."""
    messages = list(history)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    messages += input_messages(req)
    extra = req.model_extra or {}
    body: dict[str, Any] = {k: extra[k] for k in PASSED_FIELDS if k in extra}
    body.update({k: v for k, v in extra.items() if k in REFUSED})  # refused there, by name
    body.update(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                temperature=req.temperature, top_p=req.top_p, priority=req.priority,
                request_id=req.request_id, parallel_tool_calls=req.parallel_tool_calls)
    if wants_logprobs(req):  # chat's logprobs: top_logprobs checked there, by that name
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    if req.tools is not None:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    fmt = _response_format(req.text)
    if fmt is not None and not _forces_a_call(req.tool_choice):
        body["response_format"] = fmt
    return ChatCompletionRequest.model_validate(body)


def _text_of(content, where: str) -> str:
    """A message's content (a string or input_text / output_text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(f"{where}.content: a string or a list of text parts is required",
                         f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise FieldError(f"{where}.content.{j}: parts of type {kind!r} are not supported "
                             "(text only)", f"{where}.content.{j}")
        texts.append(part.get("text", ""))
    return "".join(texts)


def _required(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise FieldError(f"{where}.{name}: a string is required", f"{where}.{name}")
    return value


def _chat_tool(tool: dict, i: int) -> dict:
    """A Responses function tool (flat) as a chat tool (nested under `function`)."""
    if tool.get("type") != "function":
        raise FieldError(f"tools.{i}.type: only function tools are supported, not "
                         f"{tool.get('type')!r}", f"tools.{i}.type")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice) -> Union[str, dict]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise FieldError(f"tool_choice: {choice.get('type')!r} is not supported (none, auto, "
                     "required, or a function by name)", "tool_choice")


def _forces_a_call(choice) -> bool:
    """tool_choice "required" or a function by name: the output is function calls only,
    each under its tool's schema, so text.format (which shapes output text, OpenAI's
    rule) has no text to apply to. instructor's RESPONSES_TOOLS sends both."""
    return choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function")


def _response_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format (frontend_svc/structured/response_format.py)."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise FieldError(f"text.format.type: {fmt.get('type')!r} is not supported (text, "
                     "json_object, json_schema)", "text.format.type")
