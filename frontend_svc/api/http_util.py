"""HTTP plumbing: OpenAI-shaped errors for every failure, and client-disconnect
detection for streaming and non-streaming responses, so a client that goes away
aborts its request instead of leaving it to run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.types import InvalidRequestError

from frontend_svc.request.admission import RETRY_AFTER_S
from frontend_svc.api.auth import Forbidden, Unauthenticated
from frontend_svc.request.caps import REJECTED
from frontend_svc.errors import EngineError, FieldError, error_body
from frontend_svc.api.protocol import MAX_REQUEST_ID_CHARS

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
# A lone UTF-16 surrogate, as a JSON escape or as raw (CESU-style) bytes: json.loads
# accepts both, and the tokenizer then fails on the string it returns.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    # a 429 says when to come back, as OpenAI's and TGI's do
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(error_body(message, status, param), status_code=status,
                        headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; OpenAI clients expect 400 for any malformed body.
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request body")
        return error_response(400, f"{param}: {message}" if param else message, param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), getattr(exc, "param", None))

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(exc.http_status, exc.message)

    @app.exception_handler(HttpError)
    async def _http(_: Request, exc: HttpError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(Unauthenticated)
    @app.exception_handler(Forbidden)
    async def _auth(_: Request, exc: Unauthenticated | Forbidden) -> JSONResponse:
        return error_response(exc.status, str(exc))

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> JSONResponse:
        return error_response(499, "the client closed the request")

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


def parse_body(body: bytes, model: type[M]) -> M:
    """A request body as `model` (run it on the tokenizer pool: a body of up to
    --payload-limit bytes takes long to parse). Bad JSON, a string that is not
    valid Unicode, or a field of the wrong type is a 400 naming what is wrong."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        REJECTED.labels("bad_json").inc()
        where = f" at line {exc.lineno} column {exc.colno}" \
            if isinstance(exc, json.JSONDecodeError) else ""
        raise FieldError(f"the request body is not valid JSON{where}: "
                         f"{getattr(exc, 'msg', None) or exc.reason}", None) from None
    if _MAYBE_SURROGATE.search(body):
        path = _unencodable_path(data, ())
        if path is not None:
            REJECTED.labels("bad_text").inc()
            param = ".".join(map(str, path)) or None
            raise FieldError(f"{param or 'the body'} contains a lone UTF-16 surrogate, "
                             "which is not valid Unicode text", param)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _unencodable_path(value, path: tuple) -> tuple | None:
    """Where the first string that UTF-8 cannot encode is (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _unencodable_path(key, path)
            if found is None:
                found = _unencodable_path(item, (*path, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _unencodable_path(item, (*path, i))
            if found is not None:
                return found
    return None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client
    disconnects first; then raises ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and close their generator (aborting its
    requests), as soon as the client disconnects, whether or not a write fails."""

    def __init__(self, content, **kwargs) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"}, **kwargs)

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            with contextlib.suppress(OSError):
                await self.stream_response(send)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streamer = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def check_model(fe, name: str | None) -> None:
    """A request naming another model than the served one is a 404 (OpenAI's)."""
    if name is not None and name != fe.served_model_name:
        raise HttpError(404, f"The model `{name}` does not exist.", "model")


async def primed(request: Request, stream: AsyncIterator):
    """Wait for the first delta before answering 200, so that a request the
    scheduler rejects gets its HTTP error status instead of a broken stream."""
    first = await unless_disconnected(request, anext(stream))
    return first, stream


async def chain(first, rest: AsyncIterator) -> AsyncIterator:
    """The primed first item, then the rest of the stream; closes the stream."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


def response_ids(request: Request, body_id: str | None, prefix: str,
                 fresh: str) -> tuple[str, str]:
    """vLLM's rule: the response id is `prefix` and the X-Request-Id header, else the
    body's request_id, else `fresh`. Also the base of its choices' ids at the scheduler,
    which a client's id gets a random part in: two requests may reuse one (vLLM's
    engine ids are unique the same way)."""
    given = request.headers.get("x-request-id") or body_id
    if given is None:
        return fresh, fresh
    if len(given) > MAX_REQUEST_ID_CHARS:
        raise HttpError(400, f"the request id (X-Request-Id or request_id) has {len(given)} "
                             f"characters; at most {MAX_REQUEST_ID_CHARS} are accepted",
                        "request_id")
    resp_id = f"{prefix}{given}"
    return resp_id, f"{resp_id}-{uuid.uuid4().hex[:8]}"
