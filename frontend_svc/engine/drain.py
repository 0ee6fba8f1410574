"""SIGTERM without cut streams (docs/resilience.md, "Draining a frontend").

On SIGTERM the frontend keeps its ports open and serves what it holds:
- /ready answers 503 at once (a load balancer stops routing here) and gRPC health
  says NOT_SERVING; /health stays 200 (the process is alive, do not kill it);
- new generation requests get 503 with Retry-After (HTTP) or UNAVAILABLE (gRPC),
  so a client retries on another replica;
- running requests may finish until --drain-timeout-s; any still open then ends
  with an OpenAI-shaped error event and `data: [DONE]` (a non-streamed one with a
  503 body, gRPC with UNAVAILABLE), never a cut connection;
- then the HTTP server stops, with nothing left to cut.
"""

from __future__ import annotations

import asyncio
import json

import grpc

from frontend_svc.request.admission import RETRY_AFTER_S, Admission
from frontend_svc.engine.engine_client import EngineClient
from frontend_svc.errors import EngineError
from frontend_svc.api.http_guard import GENERATE_PATHS, guard_error
from shared.telemetry import get_logger

log = get_logger(component="drain")
POLL_S = 0.05  # shutdown only: how often the drain looks at what is left
FLUSH_S = 5.0  # after the deadline, for the streams to write their last events
GENERATE_METHOD = "/gapserve.v1.Generation/Generate"


class Drain:
    def __init__(self) -> None:
        self.draining = False

    async def run(self, admission: Admission, engine: EngineClient, timeout_s: float) -> int:
        """Wait for the requests in flight to finish, at most timeout_s; end the rest
        with an error. Returns how many were ended that way."""
        self.draining = True
        loop = asyncio.get_running_loop()
        log.info("draining", in_flight=admission.in_flight, drain_timeout_s=timeout_s)
        deadline = loop.time() + timeout_s
        while admission.in_flight and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        cut = 0
        if admission.in_flight:
            cut = engine.shutdown(EngineError(
                grpc.StatusCode.UNAVAILABLE,
                f"the server is shutting down: this request did not finish within the "
                f"drain timeout ({timeout_s:g} s, --drain-timeout-s); retry it"))
            flush = loop.time() + FLUSH_S
            while admission.in_flight and loop.time() < flush:
                await asyncio.sleep(POLL_S)
        log.info("drained", ended_with_error=cut, left=admission.in_flight)
        return cut


class DrainGuard:
    """ASGI, outermost: while draining, /ready and new generation requests get 503."""

    def __init__(self, app, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.drain.draining:
            if scope["path"] == "/ready":
                return await _send_503(send, "/ready", "not ready: this frontend is shutting down")
            if scope["path"] in GENERATE_PATHS:
                return await _send_503(send, scope["path"], "this frontend is shutting down; "
                                       "retry the request (another replica may take it)")
        await self.app(scope, receive, send)


async def _send_503(send, path: str, message: str) -> None:
    data = json.dumps(guard_error(path, 503, message)).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": data})


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """While draining, a new gRPC Generate call is refused with UNAVAILABLE."""

    def __init__(self, drain: Drain) -> None:
        self.drain = drain

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not self.drain.draining or details.method != GENERATE_METHOD:
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "this frontend is shutting down; retry the request")

        return grpc.unary_stream_rpc_method_handler(
            refuse, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
