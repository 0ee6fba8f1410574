"""The client-facing gRPC service (generate.proto's Generation): a thin
translation between protobuf and the frontend's choices."""

from __future__ import annotations

import time
from contextlib import aclosing

import grpc

from shared.wire.common import logprobs_to_proto, model_info_to_proto, sampling_from_proto
from shared.wire.readout import message_from
from shared.proto import generate_pb2, generate_pb2_grpc
from shared.structured.compile_cache import validate
from shared.structured.spec import CompileCapacityError, StructuredOutputError
from shared.types import FinishReason, InvalidRequestError

from frontend_svc.request import generation
from frontend_svc.api.auth import Forbidden, Unauthenticated, bearer
from frontend_svc.request.caps import REJECTED
from frontend_svc.request.context import Frontend
from frontend_svc.errors import EngineError
from frontend_svc.request.choice import Choice
from frontend_svc.request.output_stream import OutputStream
from frontend_svc.request.translate import (
    GenerationInput, ModelLimits, check_prompt, encode, stop_strings)

SERVICE_NAME = "gapserve.v1.Generation"


def generate_input(req: generate_pb2.GenerateRequest, fe: Frontend) -> GenerationInput:
    """Validate and tokenize (call it on fe.pool); raises InvalidRequestError
    naming the problem. The grammar is compiled next, on the grammar pool
    (check_structured_output)."""
    limits = fe.limits
    params = sampling_from_proto(req.sampling_params)
    params.validate(limits.vocab_size)
    stops = stop_strings(list(req.stop), limits.caps, params.stop_token_ids)
    add_special = req.add_special_tokens if req.HasField("add_special_tokens") else True
    which = req.WhichOneof("input")
    if which == "text":
        limits.caps.check_text(req.text)
        ids = encode(fe.tokenizer, req.text, add_special, "text")
    elif which == "token_ids":
        ids = list(req.token_ids.ids)
    else:
        raise InvalidRequestError("give the prompt as text or token_ids")
    check_prompt(ids, params, limits)
    return GenerationInput(
        ids, params, stops, None,
        req.include_stop_str_in_output if req.HasField("include_stop_str_in_output") else False,
        req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        req.priority, req.cache_salt if req.HasField("cache_salt") else None)


def check_structured_output(inp: GenerationInput, limits: ModelLimits) -> GenerationInput:
    """Compile the request's grammar before anything is queued, as the HTTP path
    does: on the frontend's grammar pool (call it there), through the same cache,
    within the same --structured-outputs-compile-timeout-s. A bad schema, regex,
    choice list or grammar is an InvalidRequestError naming the part at fault
    (INVALID_ARGUMENT); no compile possible now (too many stuck past the timeout)
    is RESOURCE_EXHAUSTED."""
    spec = inp.params.structured_output
    if spec is None:
        return inp
    start = time.perf_counter()
    try:
        if limits.grammar_vocab is None:
            raise StructuredOutputError("structured outputs are not available on this "
                                        "frontend")
        inp.cache_hit = validate(spec, limits.grammar_vocab(), limits.compile_timeout_s)
    except CompileCapacityError as exc:
        REJECTED.labels("compile_capacity").inc()
        raise EngineError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"structured_output: {exc.message}") from None
    except StructuredOutputError as exc:
        REJECTED.labels("structured_output").inc()
        raise InvalidRequestError(f"structured_output.{exc.field}: {exc.message}") from None
    inp.compile_s = time.perf_counter() - start
    return inp


def tokenize_reply(req: generate_pb2.TokenizeRequest, fe: Frontend
                   ) -> generate_pb2.TokenizeResponse:
    """Validate and tokenize (call it on fe.pool)."""
    limits = fe.limits
    limits.caps.check_text(req.text)
    add_special = req.add_special_tokens if req.HasField("add_special_tokens") else True
    ids = encode(fe.tokenizer, req.text, add_special, "text")
    return generate_pb2.TokenizeResponse(token_ids=ids, tokens=fe.tokenizer.tokens(ids),
                                         max_model_len=limits.max_model_len)


def final_message(state: OutputStream) -> generate_pb2.GenerateFinal:
    c = state.choice
    final = generate_pb2.GenerateFinal(
        finish_reason=int(c.finish_reason or FinishReason.ABORT),
        usage=generate_pb2.Usage(  # the client API's names (OpenAI's usage)
            prompt_tokens=c.num_prompt_tokens,
            completion_tokens=c.num_completion_tokens,
            total_tokens=c.num_prompt_tokens + c.num_completion_tokens,
            cached_tokens=c.num_cached_tokens),
        # by name: the timings the choice computes, then its own (arrival, preemptions)
        timings=message_from(generate_pb2.RequestTimings, c.timings_ms(), c))
    if isinstance(c.stop_reason, str):
        final.stop_str = c.stop_reason
    elif c.stop_reason is not None:
        final.stop_token_id = c.stop_reason
    return final


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, fe: Frontend) -> None:
        self.fe = fe  # (its grammar vocabulary is warmed when the scheduler connects)
        # (the caller's key, the client's request id) -> the scheduler's id: a caller
        # sees and aborts only its own requests
        self.active: dict[tuple[str, str], str] = {}

    async def _caller(self, context) -> str:
        """The caller's API key (gRPC metadata `authorization: Bearer <key>`)."""
        token = bearer(dict(context.invocation_metadata() or ()).get("authorization"))
        try:
            return self.fe.keys.identify(token)
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    async def Generate(self, request, context):
        caller = await self._caller(context)
        client_id = request.request_id or self.fe.new_id("gen")
        key = (caller, client_id)
        choice = None
        try:
            # RESOURCE_EXHAUSTED when the queue is full, before any tokenizing
            with self.fe.admission.admit(1):
                try:
                    self.fe.keys.check_priority(caller, request.priority)
                    inp = await self.fe.offload(generate_input, request, self.fe)
                    if inp.params.structured_output is not None:  # not behind a compile
                        inp = await self.fe.offload_grammar(check_structured_output, inp,
                                                            self.fe.limits)
                except Forbidden as exc:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
                except InvalidRequestError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                if key in self.active:  # checked here: no await until it is taken
                    await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                        f"request {client_id!r} is already running")
                choice = Choice(self.fe.new_id("grpc"), inp, inp.params,
                                context.invocation_metadata(), "text_completion")
                self.active[key] = choice.req_id
                async with aclosing(generation.stream(self.fe.engine, self.fe.tokenizer,
                                                      choice, self.fe.observer)) as deltas:
                    async for state, delta in deltas:
                        msg = generate_pb2.GenerateResponse(
                            request_id=client_id, token_ids=delta.token_ids,
                            text=delta.text,
                            logprobs=[logprobs_to_proto(x) for x in delta.logprobs])
                        if delta.finished:
                            msg.final.CopyFrom(final_message(state))
                        yield msg
        except EngineError as exc:
            await context.abort(exc.code, exc.message)
        finally:
            if choice is not None and self.active.get(key) == choice.req_id:
                del self.active[key]

    async def Abort(self, request, context):
        caller = await self._caller(context)
        ids = [self.active[(caller, i)] for i in request.request_ids
               if (caller, i) in self.active]
        return generate_pb2.AbortResponse(num_aborted=self.fe.engine.abort(ids))

    async def Tokenize(self, request, context):
        await self._caller(context)
        try:
            with self.fe.admission.admit(1):  # like HTTP /tokenize: a slot, then the pool
                return await self.fe.offload_utility(tokenize_reply, request, self.fe)
        except EngineError as exc:
            await context.abort(exc.code, exc.message)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def GetModelInfo(self, request, context):
        await self._caller(context)
        info = self.fe.engine.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected")
        return generate_pb2.GetModelInfoResponse(
            served_model_name=self.fe.served_model_name,
            model_info=model_info_to_proto(info))

