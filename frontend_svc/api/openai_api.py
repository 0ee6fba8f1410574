"""The OpenAI-compatible HTTP API: a thin translation between JSON and the
frontend's choices (translate.py in, openai_format.py out), as three routers:
generation, tokenize/detokenize, and the operator's (health, ready, metrics,
status, models).

Nothing that costs CPU runs on the event loop that serves every stream: request
bodies are parsed, tokenized and decoded on the tokenizer pool, structured-output
grammars compiled on the grammar pool, and every route that does so goes through
admission first (HttpGuard, then Admission.admit)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from frontend_svc.api import openai_format as fmt
from frontend_svc.api.auth import ANONYMOUS
from frontend_svc.request.context import Frontend
from frontend_svc.errors import EngineError, FieldError, error_body
from frontend_svc.request.choice import Choice
from frontend_svc.api.http_guard import HttpGuard
from frontend_svc.api.http_util import (
    SSEResponse, chain as _chain, check_model, install_error_handlers, parse_body,
    primed as _primed, response_ids, unless_disconnected)
from frontend_svc.telemetry.vllm_metrics import scrape
from frontend_svc.api.messages_api import messages_router
from frontend_svc.api.responses_api import responses_router
from frontend_svc.api.router_compat import package_version, router_compat_router
from frontend_svc.api.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
    TokenizeRequest)
from frontend_svc.request.output_stream import OutputStream
from frontend_svc.request.translate import (
    GenerationInput, ModelLimits, chat_input, chat_prompt, check_constraints,
    choices_per_prompt, completion_inputs, encode, fan_out)
from shared.speculative_config import spec_decode_summary

# slack for the other fields' commas when counting /detokenize's ids before parsing
DETOKENIZE_COMMA_SLACK = 16


def build_app(fe: Frontend, payload_limit: int = 8 << 20) -> FastAPI:
    app = FastAPI(title="gapserve", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(HttpGuard, keys=fe.keys, payload_limit=payload_limit,
                       admission=fe.admission)
    app.include_router(operator_router(fe))
    app.include_router(token_router(fe))
    app.include_router(generation_router(fe))
    app.include_router(responses_router(fe))  # OpenAI's Responses API, on the chat path
    app.include_router(router_compat_router(fe))  # sglang-router's worker endpoints
    app.include_router(messages_router(fe))  # Anthropic's Messages API, chat's path
    return app


def json_bytes(body: dict) -> Response:
    """A JSON response serialized by the caller (on the pool: a long id list is slow)."""
    return Response(json.dumps(body, separators=(",", ":")).encode(),
                    media_type="application/json")


def operator_router(fe: Frontend) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    # vLLM's and SageMaker's liveness probe: the same answer as /health
    @router.get("/ping")
    @router.post("/ping")
    async def health() -> Response:
        """Liveness: fails until the whole stack was ready once, then stays up while
        the scheduler or a worker is away (this process holds their requests)."""
        if not fe.engine.ever_ready:
            return JSONResponse(error_body("the scheduler and workers are not connected "
                                           "yet", 503), 503)
        return Response(status_code=200)

    @router.get("/ready")
    async def ready() -> Response:
        """Readiness: the scheduler session is open and the scheduler holds its workers."""
        if not fe.ready:
            return JSONResponse(error_body("not ready: the scheduler or its workers are "
                                           "not connected", 503), 503)
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict:
        """vLLM's: the server's version (here gapserve's package version)."""
        return {"version": package_version()}

    @router.get("/v1/models", response_model=None)
    async def models() -> dict | JSONResponse:
        if not fe.ready:
            return JSONResponse(error_body("the scheduler or its workers are not connected",
                                           503), 503)
        info = fe.engine.model_info
        return {"object": "list", "data": [{
            "id": fe.served_model_name, "object": "model", "created": fmt.now(),
            "owned_by": "gapserve", "root": fe.model_path,
            "max_model_len": info.max_model_len if info else None,
            **weights_metadata(info)}]}

    @router.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await scrape(fe.engine, fe.served_model_name)
        return Response(body, media_type=content_type)

    @router.get("/v1/status")
    async def status() -> dict:
        reply = await fe.engine.get_status()
        # every field, with 64-bit counters as JSON numbers (MessageToDict makes them strings)
        out = {f.name: list(getattr(reply, f.name)) if f.is_repeated else getattr(reply, f.name)
               for f in reply.DESCRIPTOR.fields}
        if reply.speculative_config:  # docs/spec_decode.md: what an operator reads first
            out["spec_decode"] = spec_decode_summary(reply)
        # the rate the diagnosis reads: preemptions per second over its window
        if out.get("window_s"):
            out["preemption_rate_per_s"] = out["num_preemptions_in_window"] / out["window_s"]
        # how the worker computes steps (kernels, row limits, threads): worker_svc/compute_plan.py
        out["compute_plan"] = fe.engine.model_info.compute_plan if fe.engine.model_info else None
        if hasattr(fe.engine, "describe"):  # data parallelism: a row per replica (replicas.py)
            out["replicas"] = fe.engine.describe()
        return out

    return router


def weights_metadata(info) -> dict:
    """How the worker holds the weights, as extra fields of a /v1/models entry (OpenAI
    and vLLM clients ignore fields they do not know): "quantization" is "gguf" when a
    GGUF's blocks are served as they are (else None, as vLLM reports an unquantized
    model), "weights" the compute plan's path and types ("gguf_quantized:Q4_1+Q8_0",
    or "float32" for float weights; worker_svc/compute_plan.py), "quant_activations"
    how the quantized path takes the activations ("float32" exact, "int8"), None for
    float weights."""
    plan = dict(p.split("=", 1) for p in (info.compute_plan if info else "").split()
                if "=" in p)
    weights = plan.get("weights")
    if weights is None:
        return {"quantization": None, "weights": plan.get("dtype"), "quant_activations": None}
    return {"quantization": "gguf" if weights.startswith("gguf_quantized") else None,
            "weights": weights,
            "quant_activations": plan.get("quant_activations", "float32")}


def token_router(fe: Frontend) -> APIRouter:
    """/tokenize and /detokenize: admitted like a generation request (one place
    each), parsed and run on their own thread (Frontend.utility_pool), bounded before parsing."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await request.body()
        with fe.admission.admit(1):
            return await fe.offload_utility(_tokenize, fe, fe.limits, body)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await request.body()
        with fe.admission.admit(1):
            return await fe.offload_utility(_detokenize, fe, fe.limits, body)

    return router


def _tokenize(fe: Frontend, limits: ModelLimits, body: bytes) -> Response:
    limits.caps.check_body_for_text(len(body))
    req = parse_body(body, TokenizeRequest)
    check_model(fe, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise FieldError("give exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        for name in ("tools", "tool_choice", "chat_template", "chat_template_kwargs"):
            if getattr(req, name) is not None:
                raise FieldError(f"{name} applies to messages, not to a prompt", name)
        limits.caps.check_text(req.prompt)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = encode(fe.tokenizer, req.prompt, add_special, "prompt")
    else:
        chat = ChatCompletionRequest(
            messages=req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=bool(req.add_special_tokens), tools=req.tools,
            tool_choice=req.tool_choice, chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs)
        ids = chat_prompt(chat, fe.tokenizer, limits, fe.tools).ids
    out = {"tokens": ids, "count": len(ids), "max_model_len": limits.max_model_len}
    if req.return_token_strs:
        out["token_strs"] = fe.tokenizer.tokens(ids)
    return json_bytes(out)


def _detokenize(fe: Frontend, limits: ModelLimits, body: bytes) -> Response:
    # counted before parsing: json.loads of megabytes of ids holds the GIL throughout
    limits.caps.check_token_ids(body.count(b",") - DETOKENIZE_COMMA_SLACK,
                                limits.max_model_len)
    req = parse_body(body, DetokenizeRequest)
    check_model(fe, req.model)
    ids = req.tokens
    limits.caps.check_token_ids(len(ids), limits.max_model_len)
    vocab = limits.vocab_size
    if ids and (min(ids) < 0 or max(ids) >= vocab):  # C loops; find the id only if bad
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise FieldError(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return json_bytes({"prompt": fe.tokenizer.decode(ids, skip_special_tokens=False)})


def generation_router(fe: Frontend) -> APIRouter:
    router = APIRouter()

    def check_priority(request: Request, priority: int) -> None:
        fe.keys.check_priority(getattr(request.state, "caller", ANONYMOUS), priority)

    def ids_of(prefix: str, request: Request, req) -> tuple[str, str]:
        return response_ids(request, req.request_id, f"{prefix}-", fe.new_id(prefix))

    def choices_for(inputs: list[GenerationInput], width: int, ids: tuple[str, str],
                    request: Request, operation: str) -> list[Choice]:
        """`width` choices per prompt; choice k of the response is request `base-k`."""
        resp_id, base = ids
        if inputs:  # its structured output and tool_choice, counted and logged once
            fe.observer.constrained(resp_id, inputs[0])
        pairs = [(inp, params) for inp in inputs for params in fan_out(inp.params, width)]
        return [Choice(f"{base}-{k}", inp, params, request.headers, operation)
                for k, (inp, params) in enumerate(pairs)]

    async def admitted(request: Request, model: type):
        """The parsed body, once it passes the model, priority and early admission checks."""
        req = await fe.offload(parse_body, await request.body(), model)
        check_model(fe, req.model)
        check_priority(request, req.priority)
        # early 429: no tokenizing for a request that cannot run
        fe.admission.check(choices_per_prompt(req))
        return req

    @router.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await admitted(request, CompletionRequest)
        ids = ids_of("cmpl", request, req)
        resp_id = ids[0]
        inputs = await fe.offload(completion_inputs, req, fe.tokenizer, fe.limits)
        if inputs and inputs[0].constraint is not None:  # a free request never waits there
            inputs = await fe.offload_grammar(check_constraints, inputs, fe.limits)
        width = choices_per_prompt(req)
        choices = choices_for(inputs, width, ids, request, "text_completion")
        echo = [c.inp.prompt_text if req.echo else None for c in choices]
        prompt_lens = [len(inp.prompt_token_ids) for inp in inputs]
        if req.stream:
            first, rest = await _primed(request, fe.stream(choices))
            return SSEResponse(_completion_events(fe, req, resp_id, choices, echo,
                                                  prompt_lens, first, rest))
        states = await unless_disconnected(request, fe.run(choices))
        keep = fmt.best_of(states, width, req.n)
        return {"id": resp_id, "object": "text_completion", "created": fmt.now(),
                "model": fe.served_model_name,
                "choices": [fmt.completion_choice(
                    i, states[k], echo[k], _completion_logprobs(fe, req, states[k], echo[k]))
                    for i, k in enumerate(keep)],
                "usage": fmt.usage_of(prompt_lens, [states[k] for k in keep])}

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await admitted(request, ChatCompletionRequest)
        ids = ids_of("chatcmpl", request, req)
        resp_id = ids[0]
        inp = await fe.offload(chat_input, req, fe.tokenizer, fe.limits, fe.tools)
        if inp.constraint is not None:  # a free request never queues behind a compile
            [inp] = await fe.offload_grammar(check_constraints, [inp], fe.limits)
        width = choices_per_prompt(req)
        choices = choices_for([inp], width, ids, request, "chat")
        if req.stream:
            first, rest = await _primed(request, fe.stream(choices))
            return SSEResponse(_chat_events(fe, req, resp_id, choices, first, rest))
        states = await unless_disconnected(request, fe.run(choices))
        keep = fmt.best_of(states, width, req.n)
        return {"id": resp_id, "object": "chat.completion", "created": fmt.now(),
                "model": fe.served_model_name,
                "choices": [fmt.chat_choice(
                    i, states[k], inp.prompt_text,
                    fmt.chat_logprobs(fe.tokenizer, states[k].choice.output_logprobs,
                                      req.return_tokens_as_token_ids)
                    if req.logprobs
                    else None, inp.tool_plan)
                    for i, k in enumerate(keep)],
                "usage": fmt.usage_of([len(inp.prompt_token_ids)], [states[k] for k in keep])}

    return router


def _completion_logprobs(fe: Frontend, req: CompletionRequest, state: OutputStream,
                         echo_text: str | None) -> dict | None:
    if req.logprobs is None:
        return None
    return fmt.CompletionLogprobs(fe.tokenizer, len(echo_text or ""),
                                  req.return_tokens_as_token_ids).format(
        state.choice.output_logprobs)


async def _completion_events(fe: Frontend, req: CompletionRequest, resp_id: str,
                             choices: list[Choice], echo: list[str | None],
                             prompt_lens: list[int], first, rest) -> AsyncIterator[str]:
    created, model = fmt.now(), fe.served_model_name
    logprobs = ([fmt.CompletionLogprobs(fe.tokenizer, len(e or ""),
                                        req.return_tokens_as_token_ids) for e in echo]
                if req.logprobs is not None else None)
    states: dict[int, OutputStream] = {}
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
    states: dict[int, OutputStream] = {}
    echo = choices[0].inp.prompt_text
    plan = choices[0].inp.tool_plan
    parsers = {i: plan.new_parser() for i in range(len(choices))} \
        if plan is not None and plan.parses else {}
    for index in range(len(choices)):
        # with tool calls, content may never come: OpenAI's first delta has none then
        role = {"role": "assistant"} if parsers else {"role": "assistant", "content": ""}
        yield fmt.sse(fmt.chat_chunk(resp_id, created, model, index, role, None, None))
        if echo:  # vLLM sends the echoed content right after the role
            yield fmt.sse(fmt.chat_chunk(resp_id, created, model, index,
                                         {"content": echo}, None, None))
    try:
        async for index, state, delta in _chain(first, rest):
            states[index] = state
            if not delta.text and not delta.finished and not delta.logprobs:
                continue
            lps = (fmt.chat_logprobs(fe.tokenizer, delta.logprobs,
                                     req.return_tokens_as_token_ids)
                   if req.logprobs else None)
            for chunk in _chat_delta_chunks(resp_id, created, model, index, delta, lps,
                                            parsers.get(index), plan):
                yield fmt.sse(chunk)
        if req.stream_options and req.stream_options.include_usage:
            yield fmt.sse({"id": resp_id, "object": "chat.completion.chunk",
                           "created": created, "model": model, "choices": [],
                           "usage": fmt.usage_of([len(choices[0].inp.prompt_token_ids)],
                                                 list(states.values()))})
    except EngineError as exc:
        yield fmt.sse(error_body(exc.message, exc.http_status))
    yield fmt.sse("[DONE]")


def _chat_delta_chunks(resp_id: str, created: int, model: str, index: int, delta,
                       lps: dict | None, parser, plan) -> list[dict]:
    """The chunks of one delta: its text as content, or, with a tool parser, the
    parser's content and tool_calls bodies; logprobs ride on the first chunk and
    the finish reason (renamed by the tool plan) on the last."""
    if parser is None:
        body = {"content": delta.text} if delta.text else {}
        return [fmt.chat_chunk(resp_id, created, model, index, body, delta, lps)]
    bodies = parser.feed(delta.text) if delta.text else []
    if delta.finished:
        bodies += parser.finish()
    if not bodies and not delta.finished and not lps:
        return []
    bodies = bodies or [{}]
    finish = plan.finish_reason(delta.finish_name, parser.num_complete, bool(parser.cut)) \
        if delta.finished else None
    last = len(bodies) - 1
    return [fmt.chat_chunk(resp_id, created, model, index, body,
                           delta if i == last else None, lps if i == 0 else None,
                           finish if i == last else None,
                           parser.cut if i == last and delta.finished else None)
            for i, body in enumerate(bodies)]
