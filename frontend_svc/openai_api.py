"""The OpenAI-compatible HTTP API: a thin translation between JSON and the
frontend's choices (translate.py in, openai_format.py out)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from shared.types import InvalidRequestError

from frontend_svc import openai_format as fmt
from frontend_svc.auth import ANONYMOUS
from frontend_svc.context import Frontend
from frontend_svc.errors import EngineError, error_body
from frontend_svc.generation import Choice
from frontend_svc.http_guard import HttpGuard
from frontend_svc.http_util import (
    HttpError, SSEResponse, install_error_handlers, unless_disconnected)
from frontend_svc.observe import scrape
from frontend_svc.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest)
from frontend_svc.request_state import RequestState
from frontend_svc.translate import (
    GenerationInput, chat_input, completion_inputs, fan_out)


def build_app(fe: Frontend, payload_limit: int = 8 << 20) -> FastAPI:
    app = FastAPI(title="gapserve", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(HttpGuard, keys=fe.keys, payload_limit=payload_limit,
                       admission=fe.admission)

    def check_priority(request: Request, priority: int) -> None:
        fe.keys.check_priority(getattr(request.state, "caller", ANONYMOUS), priority)

    def check_model(name: str | None) -> None:
        if name is not None and name != fe.served_model_name:
            raise HttpError(404, f"The model `{name}` does not exist.", "model")

    def choices_for(inputs: list[GenerationInput], n: int, resp_id: str, request: Request,
                    operation: str) -> list[Choice]:
        """n choices per prompt; choice k of the response is request `resp_id-k`."""
        pairs = [(inp, params) for inp in inputs for params in fan_out(inp.params, n)]
        return [Choice(f"{resp_id}-{k}", inp, params, request.headers, operation)
                for k, (inp, params) in enumerate(pairs)]

    @app.get("/health")
    async def health() -> Response:
        """Liveness: fails until the whole stack was ready once, then stays up while
        the scheduler or a worker is away (this process holds their requests)."""
        if not fe.engine.ever_ready:
            return JSONResponse(error_body("the scheduler and workers are not connected "
                                           "yet", 503), 503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the scheduler session is open and the scheduler holds its workers."""
        if not fe.ready:
            return JSONResponse(error_body("not ready: the scheduler or its workers are "
                                           "not connected", 503), 503)
        return Response(status_code=200)

    @app.get("/v1/models", response_model=None)
    async def models() -> dict | JSONResponse:
        if not fe.ready:
            return JSONResponse(error_body("the scheduler or its workers are not connected",
                                           503), 503)
        info = fe.engine.model_info
        return {"object": "list", "data": [{
            "id": fe.served_model_name, "object": "model", "created": fmt.now(),
            "owned_by": "gapserve", "root": fe.model_path,
            "max_model_len": info.max_model_len if info else None}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await scrape(fe.engine, fe.served_model_name)
        return Response(body, media_type=content_type)

    @app.get("/v1/status")
    async def status() -> dict:
        reply = await fe.engine.get_status()
        # every field, with 64-bit counters as JSON numbers (MessageToDict makes them strings)
        out = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
        # the rate the diagnosis reads: preemptions per second over its window
        if out.get("window_s"):
            out["preemption_rate_per_s"] = out["num_preemptions_in_window"] / out["window_s"]
        return out

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages")
        caps = fe.limits.caps
        if req.prompt is not None:
            caps.check_text(req.prompt)
            ids = await fe.offload(fe.tokenizer.encode, req.prompt, req.add_special_tokens)
        else:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            caps.check_text(str(messages), "the messages")
            ids = await fe.offload(fe.tokenizer.apply_chat_template, messages,
                                   req.add_generation_prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": fe.limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req.model)
        vocab = fe.limits.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return {"prompt": fe.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        check_priority(request, req.priority)
        fe.admission.check(req.n)  # early 429: no tokenizing for a request that cannot run
        inputs = await fe.offload(completion_inputs, req, fe.tokenizer, fe.limits)
        resp_id = fe.new_id("cmpl")
        choices = choices_for(inputs, req.n, resp_id, request, "text_completion")
        echo = [c.inp.prompt_text if req.echo else None for c in choices]
        prompt_lens = [len(inp.prompt_token_ids) for inp in inputs]
        if req.stream:
            first, rest = await _primed(request, fe.stream(choices))
            return SSEResponse(_completion_events(fe, req, resp_id, choices, echo,
                                                  prompt_lens, first, rest))
        states = await unless_disconnected(request, fe.run(choices))
        return {"id": resp_id, "object": "text_completion", "created": fmt.now(),
                "model": fe.served_model_name,
                "choices": [fmt.completion_choice(
                    i, s, echo[i], _completion_logprobs(fe, req, s, echo[i]))
                    for i, s in enumerate(states)],
                "usage": fmt.usage_of(prompt_lens, states)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        check_priority(request, req.priority)
        fe.admission.check(req.n)
        inp = await fe.offload(chat_input, req, fe.tokenizer, fe.limits)
        resp_id = fe.new_id("chatcmpl")
        choices = choices_for([inp], req.n, resp_id, request, "chat")
        if req.stream:
            first, rest = await _primed(request, fe.stream(choices))
            return SSEResponse(_chat_events(fe, req, resp_id, choices, first, rest))
        states = await unless_disconnected(request, fe.run(choices))
        return {"id": resp_id, "object": "chat.completion", "created": fmt.now(),
                "model": fe.served_model_name,
                "choices": [fmt.chat_choice(
                    i, s, fmt.chat_logprobs(fe.tokenizer, s.logprobs) if req.logprobs else None)
                    for i, s in enumerate(states)],
                "usage": fmt.usage_of([len(inp.prompt_token_ids)], states)}

    return app


def _completion_logprobs(fe: Frontend, req: CompletionRequest, state: RequestState,
                         echo_text: str | None) -> dict | None:
    if req.logprobs is None:
        return None
    return fmt.CompletionLogprobs(fe.tokenizer, len(echo_text or "")).format(state.logprobs)


async def _primed(request: Request, stream: AsyncIterator):
    """Wait for the first delta before answering 200, so that a request the
    scheduler rejects gets its HTTP error status instead of a broken stream."""
    first = await unless_disconnected(request, anext(stream))
    return first, stream


async def _completion_events(fe: Frontend, req: CompletionRequest, resp_id: str,
                             choices: list[Choice], echo: list[str | None],
                             prompt_lens: list[int], first, rest) -> AsyncIterator[str]:
    created, model = fmt.now(), fe.served_model_name
    logprobs = ([fmt.CompletionLogprobs(fe.tokenizer, len(e or "")) for e in echo]
                if req.logprobs is not None else None)
    states: dict[int, RequestState] = {}
    pending_echo = {i: e for i, e in enumerate(echo) if e}
    try:
        async for index, state, delta in _chain(first, rest):
            states[index] = state
            text = pending_echo.pop(index, "") + delta.text
            if not text and not delta.finished and not delta.logprobs:
                continue
            lps = logprobs[index].format(delta.logprobs) if logprobs else None
            yield fmt.sse(fmt.completion_chunk(resp_id, created, model, index, text,
                                               delta, lps))
        if req.stream_options and req.stream_options.include_usage:
            yield fmt.sse({"id": resp_id, "object": "text_completion", "created": created,
                           "model": model, "choices": [],
                           "usage": fmt.usage_of(prompt_lens, list(states.values()))})
    except EngineError as exc:
        yield fmt.sse(error_body(exc.message, exc.http_status))
    yield fmt.sse("[DONE]")


async def _chat_events(fe: Frontend, req: ChatCompletionRequest, resp_id: str,
                       choices: list[Choice], first, rest) -> AsyncIterator[str]:
    created, model = fmt.now(), fe.served_model_name
    states: dict[int, RequestState] = {}
    for index in range(len(choices)):
        yield fmt.sse(fmt.chat_chunk(resp_id, created, model, index,
                                     {"role": "assistant", "content": ""}, None, None))
    try:
        async for index, state, delta in _chain(first, rest):
            states[index] = state
            if not delta.text and not delta.finished and not delta.logprobs:
                continue
            lps = fmt.chat_logprobs(fe.tokenizer, delta.logprobs) if req.logprobs else None
            body = {"content": delta.text} if delta.text else {}
            yield fmt.sse(fmt.chat_chunk(resp_id, created, model, index, body, delta, lps))
        if req.stream_options and req.stream_options.include_usage:
            yield fmt.sse({"id": resp_id, "object": "chat.completion.chunk",
                           "created": created, "model": model, "choices": [],
                           "usage": fmt.usage_of([len(choices[0].inp.prompt_token_ids)],
                                                 list(states.values()))})
    except EngineError as exc:
        yield fmt.sse(error_body(exc.message, exc.http_status))
    yield fmt.sse("[DONE]")


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    """The primed first item, then the rest of the stream; closes the stream."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
