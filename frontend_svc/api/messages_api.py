"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as vLLM
serves it, through chat's request path (messages_format.chat_request makes the
body a chat request; chat_input, check_constraints, Frontend.run / stream, the tool
parsers are chat's). Errors are Anthropic's shape. A tool call is sent whole, once
its arguments are complete, so a call cut by max_tokens is never sent (streamed or
not) and the stream equals the reply."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend_svc.api import messages_format as mf
from frontend_svc.api.http_util import (
    ClientGone, HttpError, SSEResponse, chain, parse_body, primed, unless_disconnected)
from frontend_svc.errors import EngineError
from frontend_svc.request.admission import RETRY_AFTER_S
from frontend_svc.request.context import Frontend
from frontend_svc.request.choice import Choice
from frontend_svc.request.translate import chat_input, chat_prompt, check_constraints, fan_out
from frontend_svc.structured.tool_parsers import parse_all
from frontend_svc.telemetry.observe import log
from shared.types import InvalidRequestError


def _error(exc: Exception) -> JSONResponse:
    """Any failure of a Messages route in Anthropic's shape and status (its SDK raises
    the matching error class), with Retry-After on a 429 as chat's."""
    if isinstance(exc, HttpError):
        status, message = exc.status, exc.message
    elif isinstance(exc, RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        status, message = 400, f"{where}: {first.get('msg', 'invalid request body')}"
    elif isinstance(exc, InvalidRequestError):
        status, message = 400, str(exc)
    elif isinstance(exc, EngineError):
        status, message = exc.http_status, exc.message
    elif isinstance(exc, ClientGone):
        status, message = 499, "the client closed the request"
    elif isinstance(exc, StarletteHTTPException):  # a chunked body over --payload-limit
        status, message = exc.status_code, str(exc.detail)
    else:
        raise exc
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(mf.error_body(status, message), status_code=status, headers=headers)


def messages_router(fe: Frontend) -> APIRouter:
    router = APIRouter()

    def check_model(name: str | None) -> None:
        if name is not None and name != fe.served_model_name:
            raise HttpError(404, f"model: {name}")

    @router.post("/v1/messages")
    async def messages(request: Request):
        try:
            req = await fe.offload(parse_body, await request.body(), mf.MessagesRequest)
            check_model(req.model)
            fe.admission.check(1)
            chat = mf.chat_request(req)
            inp = await fe.offload(chat_input, chat, fe.tokenizer, fe.limits, fe.tools)
            if inp.constraint is not None:
                [inp] = await fe.offload_grammar(check_constraints, [inp], fe.limits)
            resp_id = fe.new_id("msg")
            fe.observer.constrained(resp_id, inp)
            [params] = fan_out(inp.params, 1)
            choices = [Choice(f"{resp_id}-0", inp, params, request.headers, "messages")]
            if req.stream:
                first, stream = await primed(request, fe.stream(choices))
                return SSEResponse(_events(fe, resp_id, inp, first, stream))
            [state] = await unless_disconnected(request, fe.run(choices))
        except Exception as exc:  # noqa: BLE001  (_error re-raises what it does not know)
            return _error(exc)
        return _reply(fe, resp_id, inp, state)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            req = await fe.offload(parse_body, await request.body(), mf.CountTokensRequest)
            check_model(req.model)
            chat = mf.count_request(req)
            ids = await fe.offload(lambda: chat_prompt(chat, fe.tokenizer, fe.limits,
                                                       fe.tools).ids)
        except Exception as exc:  # noqa: BLE001
            return _error(exc)
        return {"input_tokens": len(ids)}

    return router


def _reply(fe: Frontend, resp_id: str, inp, state) -> dict:
    plan = inp.tool_plan
    finish = _finish_name(state)
    if plan is not None and plan.parses:
        content, calls = parse_all(plan.new_parser(), state.text)
    else:
        content, calls = state.text, []
    blocks = ([{"type": "text", "text": content}] if content else []) + \
        [mf.tool_use(c) for c in calls]
    reason, sequence = mf.stop_reason(finish, state.choice.stop_reason, len(calls))
    return mf.message(resp_id, fe.served_model_name, blocks, reason, sequence,
                      len(inp.prompt_token_ids), state.choice.num_completion_tokens)


def _finish_name(state) -> str | None:
    return {1: "stop", 2: "length", 3: "abort"}.get(int(state.choice.finish_reason)) \
        if state.choice.finish_reason else None


async def _events(fe: Frontend, resp_id: str, inp, first, rest) -> AsyncIterator[str]:
    """Anthropic's event sequence. Text streams as it comes; a tool_use block goes
    out whole when its call is complete (the next body or the end), so a cut call
    is never sent."""
    plan = inp.tool_plan
    parser = plan.new_parser() if plan is not None and plan.parses else None
    yield mf.event("message_start", {"message": mf.message(
        resp_id, fe.served_model_name, [], None, None, len(inp.prompt_token_ids), 0)})
    yield mf.event("ping", {})
    blocks = Blocks(parser.cut if parser is not None else [])
    state = None
    try:
        async for _, state, delta in chain(first, rest):
            bodies = ([{"content": delta.text}] if parser is None else parser.feed(delta.text)) \
                if delta.text else []
            if delta.finished and parser is not None:
                bodies += parser.finish()
            for body in bodies:
                for out in blocks.add(body):
                    yield out
            if delta.finished:
                for out in blocks.close():
                    yield out
                reason, sequence = mf.stop_reason(delta.finish_name, delta.stop_reason,
                                                  blocks.num_calls)
                yield mf.event("message_delta", {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": state.choice.num_completion_tokens}})
                yield mf.event("message_stop", {})
    except EngineError as exc:
        log.warning("messages stream ended by an error", error=exc.message)
        yield mf.event("error", {"error": mf.error_body(exc.http_status, exc.message)["error"]})


class Blocks:
    """The content blocks of a streamed reply: text deltas as they come, each tool
    call held until complete and then sent, unless the tool parser lists it in `cut`
    (a list it fills as it finds them: the last call cut by max_tokens, or any call
    broken after its name)."""

    def __init__(self, cut: list[dict]) -> None:
        self.cut = cut
        self.index = -1
        self.text_open = False
        self.call: dict | None = None  # the call being generated: id, name, arguments
        self.num_calls = 0

    def add(self, body: dict) -> list[str]:
        out: list[str] = []
        if "content" in body:
            out += self._flush_call()
            if not self.text_open:
                self.index += 1
                self.text_open = True
                out.append(mf.event("content_block_start", {
                    "index": self.index, "content_block": {"type": "text", "text": ""}}))
            out.append(mf.event("content_block_delta", {
                "index": self.index, "delta": {"type": "text_delta", "text": body["content"]}}))
        for delta in body.get("tool_calls", ()):
            if "id" in delta:
                out += self._close_text() + self._flush_call()
                self.call = {"id": delta["id"], "name": delta["function"]["name"],
                             "arguments": delta["function"]["arguments"]}
            else:
                self.call["arguments"] += delta["function"]["arguments"]
        return out

    def close(self) -> list[str]:
        return self._close_text() + self._flush_call()

    def _close_text(self) -> list[str]:
        if not self.text_open:
            return []
        self.text_open = False
        return [mf.event("content_block_stop", {"index": self.index})]

    def _flush_call(self) -> list[str]:
        call, self.call = self.call, None
        if call is None or any(c["id"] == call["id"] for c in self.cut):
            return []  # its arguments do not parse: never sent
        self.index += 1
        self.num_calls += 1
        return [mf.event("content_block_start", {"index": self.index, "content_block": {
                    "type": "tool_use", "id": call["id"], "name": call["name"], "input": {}}}),
                mf.event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": call["arguments"]}}),
                mf.event("content_block_stop", {"index": self.index})]
