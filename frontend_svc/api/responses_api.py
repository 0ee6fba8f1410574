"""POST /v1/responses (OpenAI's Responses API), GET and DELETE
/v1/responses/{id}: a request is translated into a chat completion request
(responses_protocol.py) and runs the chat path unchanged (chat_input: template,
tools, structured outputs; the same admission, generation, metrics and spans);
its reply is folded into output items (responses_format.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from frontend_svc.api import openai_format as fmt
from frontend_svc.api.auth import ANONYMOUS
from frontend_svc.api.http_util import (
    HttpError, SSEResponse, chain, check_model, parse_body, primed, response_ids,
    unless_disconnected)
from frontend_svc.api.responses_format import (
    ResponseOutput, Sequencer, response_body)
from frontend_svc.api.responses_protocol import (
    OUTPUT_LOGPROBS, ResponsesRequest, chat_request, check_responses_refused, input_messages,
    wants_logprobs)
from frontend_svc.api.responses_store import ResponseStore
from frontend_svc.errors import EngineError, FieldError
from frontend_svc.request.context import Frontend
from frontend_svc.request.choice import Choice
from frontend_svc.request.output_stream import OutputStream
from frontend_svc.request.translate import check_constraints, chat_input, fan_out
from frontend_svc.telemetry.observe import log


def responses_router(fe: Frontend, store: ResponseStore | None = None) -> APIRouter:
    router = APIRouter()
    store = store if store is not None else ResponseStore()

    @router.post("/v1/responses")
    async def create(request: Request):
        req: ResponsesRequest = await fe.offload(parse_body, await request.body(),
                                                 ResponsesRequest)
        check_model(fe, req.model)
        fe.keys.check_priority(getattr(request.state, "caller", ANONYMOUS), req.priority)
        fe.admission.check(1)  # early 429: no tokenizing for a request that cannot run
        check_responses_refused(req)
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = store.get(req.previous_response_id)
            if previous is None:
                raise HttpError(404, f"Response with id '{req.previous_response_id}' not "
                                     "found (stored responses are kept in memory, bounded "
                                     "in number and age)", "previous_response_id")
            history = previous.messages
        try:
            chat = chat_request(req, history)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from None
        resp_id, base = response_ids(request, req.request_id, "resp_",
                                     f"resp_{uuid.uuid4().hex}")
        inp = await fe.offload(chat_input, chat, fe.tokenizer, fe.limits, fe.tools)
        plan = inp.tool_plan
        parser = plan.new_parser() if plan is not None and plan.parses else None
        logprobs = _logprobs_of(fe) if wants_logprobs(req) else None
        if logprobs is not None and parser is not None:
            raise FieldError(f"include {OUTPUT_LOGPROBS!r} cannot be combined with tool "
                             "calling: a call's tokens have no output_text to carry their "
                             "logprobs (send tool_choice \"none\", or use "
                             "/v1/chat/completions)", "include")
        if inp.constraint is not None:  # a free request never queues behind a compile
            [inp] = await fe.offload_grammar(check_constraints, [inp], fe.limits)
        fe.observer.constrained(resp_id, inp)
        [params] = fan_out(inp.params, 1)
        choice = Choice(f"{base}-0", inp, params, request.headers, "chat")
        conversation = history + input_messages(req)
        log.info("responses request", request_id=resp_id, stream=req.stream,
                 store=bool(req.store), previous_response_id=req.previous_response_id,
                 history_messages=len(history), logprobs=logprobs is not None)
        if req.stream:
            first, rest = await primed(request, fe.stream([choice]))
            return SSEResponse(_events(fe, req, resp_id, parser, logprobs, conversation,
                                       store, first, rest))
        [state] = await unless_disconnected(request, fe.run([choice]))
        out = ResponseOutput(parser.cut if parser else ())
        out.feed(parser.feed(state.text) + parser.finish() if parser
                 else [{"content": state.text}],
                 logprobs(state.choice.output_logprobs) if logprobs else ())
        return _finished(fe, req, resp_id, out, state, conversation, store)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        stored = store.get(response_id)
        if stored is None:
            raise HttpError(404, f"Response with id '{response_id}' not found", "response_id")
        return stored.response

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        if not store.delete(response_id):
            raise HttpError(404, f"Response with id '{response_id}' not found", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def _finished(fe: Frontend, req: ResponsesRequest, resp_id: str, out: ResponseOutput,
              state: OutputStream, conversation: list[dict], store: ResponseStore) -> dict:
    """Close the output, build the Response, and store it with its conversation."""
    finish = fmt._finish(state.choice.finish_reason)
    status = "incomplete" if finish == "length" else "completed"
    out.close(status)
    body = response_body(resp_id, fmt.now(), fe.served_model_name, req, out.items, status,
                         finish, state)
    if req.store:
        reply = {"role": "assistant", "content": out.text}
        if out.tool_calls:
            reply["tool_calls"] = out.tool_calls
        store.put(resp_id, body, conversation + [reply])
    return body


def _logprobs_of(fe: Frontend):
    """Tokens' logprobs as output_text logprobs: chat's entries (token, logprob, bytes,
    top_logprobs), which are OpenAI's Responses entries too."""
    return lambda lps: fmt.chat_logprobs(fe.tokenizer, lps)["content"]


async def _events(fe: Frontend, req: ResponsesRequest, resp_id: str, parser, logprobs,
                  conversation: list[dict], store: ResponseStore, first,
                  rest) -> AsyncIterator[str]:
    seq, out = Sequencer(), ResponseOutput(parser.cut if parser else ())
    started = response_body(resp_id, fmt.now(), fe.served_model_name, req, [],
                            "in_progress", None, None)
    yield fmt.sse(seq.number({"type": "response.created", "response": started}))
    yield fmt.sse(seq.number({"type": "response.in_progress", "response": started}))
    state = None
    try:
        async for _, state, delta in chain(first, rest):
            bodies = (parser.feed(delta.text) if delta.text else []) if parser \
                else ([{"content": delta.text}] if delta.text else [])
            if delta.finished and parser:
                bodies += parser.finish()
            for event in out.feed(bodies, logprobs(delta.logprobs) if logprobs else ()):
                yield fmt.sse(seq.number(event))
        finish = fmt._finish(state.choice.finish_reason)
        for event in out.close("incomplete" if finish == "length" else "completed"):
            yield fmt.sse(seq.number(event))
        body = _finished(fe, req, resp_id, out, state, conversation, store)
        yield fmt.sse(seq.number({"type": "response.completed", "response": body}))
    except EngineError as exc:
        yield fmt.sse(seq.number({"type": "error", "code": str(exc.http_status),
                                  "message": exc.message, "param": None}))
