"""The HTTP API's front door, as plain ASGI (so streaming and disconnect detection
pass through untouched): API-key check (401; the key in `Authorization: Bearer` or
`x-api-key`) on every route but the open ones,
an immediate 429 while admission is full (before the body is read), and the
body-size limit (413), enforced on Content-Length and on the bytes that
actually arrive (a chunked body has no Content-Length). It is also the last
resort for a bug: one log line and OpenAI's 500 body, instead of Starlette's
re-raise that uvicorn logs a second time. Its errors come in OpenAI's shape, but on
Anthropic's Messages routes in Anthropic's (guard_error), as each API's SDK parses."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException

from frontend_svc.request.admission import RETRY_AFTER_S
from frontend_svc.api import messages_format
from frontend_svc.api.auth import ApiKeys, Unauthenticated, presented_key
from frontend_svc.request.caps import REJECTED
from frontend_svc.errors import EngineError, error_body
from frontend_svc.telemetry.observe import log

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})  # probes and scrapers need no key
# the routes that cost CPU or a request slot: all go through admission
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions",  # a drain refuses these
                            "/v1/responses", "/v1/messages"})
ADMITTED_PATHS = GENERATE_PATHS | {"/tokenize", "/detokenize", "/v1/messages/count_tokens"}
# Anthropic's Messages API: its errors come in Anthropic's shape
MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def guard_error(path: str, status: int, message: str) -> dict:
    """The body of an error answered before the route runs (a guard's): Anthropic's
    `{"type": "error", "error": {"type", "message"}}` on the Messages routes, else
    OpenAI's (an unknown key is OpenAI's `invalid_api_key` code there)."""
    if path in MESSAGES_PATHS:
        return messages_format.error_body(status, message)
    body = error_body(message, status)
    if status == 401:
        body["error"]["code"] = "invalid_api_key"  # OpenAI's code for this case
    return body


class PayloadTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        REJECTED.labels("payload").inc()
        super().__init__(413, f"the request body is larger than {limit} bytes "
                              "(--payload-limit)")


class HttpGuard:
    def __init__(self, app, keys: ApiKeys, payload_limit: int, admission=None) -> None:
        self.app = app
        self.keys = keys
        self.limit = payload_limit
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if scope["path"] not in OPEN_PATHS:
            try:
                caller = self.keys.identify(presented_key(headers.get(b"authorization"),
                                                          headers.get(b"x-api-key")))
            except Unauthenticated as exc:
                return await _send_json(send, 401, guard_error(scope["path"], 401, str(exc)),
                                        [(b"www-authenticate", b"Bearer")])
            scope.setdefault("state", {})["caller"] = caller
        if self.admission is not None and scope["path"] in ADMITTED_PATHS:
            try:  # full already: refuse before reading or parsing the body
                self.admission.check(1)
            except EngineError as exc:
                return await _send_json(send, 429, guard_error(scope["path"], 429, exc.message),
                                        [(b"retry-after", str(RETRY_AFTER_S).encode())])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            exc = PayloadTooLarge(self.limit)
            return await _send_json(send, 413, guard_error(scope["path"], 413, exc.detail))
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._limited(receive), tracked_send)
        except Exception as exc:  # a bug: answer in the shape clients parse, log it once
            log.error("unexpected error", path=scope["path"], error=repr(exc), exc_info=exc)
            if not started:
                await _send_json(send, 500, guard_error(scope["path"], 500,
                                                        "internal server error"))

    def _limited(self, receive):
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise PayloadTooLarge(self.limit)
            return message

        return limited_receive


async def _send_json(send, status: int, body: dict, headers=()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})
