"""The frontend's side of the scheduler: one long-lived bidirectional Session
stream that carries every request of this frontend (adds and aborts out, per-step
outputs back), routed to one asyncio queue per request.

Losing the session loses its requests at the scheduler too (it aborts a closed
session's requests), so they all end with UNAVAILABLE and a new session is opened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from shared import proto_convert as convert
from shared.grpc_server import CHANNEL_OPTIONS
from shared.link_security import LinkSecurity
from shared.proto import common_pb2, engine_pb2, engine_pb2_grpc
from shared.telemetry import get_logger
from shared.types import FinishReason, ModelInfo, RequestOutput, SamplingParams

from frontend_svc.errors import EngineError

log = get_logger(component="engine_client")
RECONNECT_DELAY_S = 0.5  # between attempts while the scheduler is away
MODEL_INFO_TIMEOUT_S = 30.0  # one attempt; the scheduler answers once its workers are up

Item = RequestOutput | EngineError


class EngineClient:
    def __init__(self, address: str,
                 on_connection: Callable[[bool], Awaitable[None]] | None = None,
                 security: LinkSecurity | None = None) -> None:
        self.address = address
        self._on_connection = on_connection  # e.g. flips the health status
        security = security or LinkSecurity()  # TLS and the scheduler's internal token
        self._metadata = security.metadata
        self._channel = security.channel(address, CHANNEL_OPTIONS, aio=True)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._outbox: asyncio.Queue[engine_pb2.EngineRequest | None] | None = None
        self._session_task: asyncio.Task | None = None
        self._closed = False
        self.connected = asyncio.Event()
        self.model_info: ModelInfo | None = None

    # ---- lifecycle

    async def start(self) -> None:
        """Open the session (waiting for the scheduler); returns once connected."""
        self._session_task = asyncio.create_task(self._run_sessions())
        await self.connected.wait()

    async def _fetch_model_info(self) -> ModelInfo:
        while True:
            try:
                reply = await self._stub.GetModelInfo(
                    common_pb2.GetModelInfoRequest(), wait_for_ready=True,
                    timeout=MODEL_INFO_TIMEOUT_S, metadata=self._metadata)
                return convert.model_info_from_proto(reply)
            except grpc.aio.AioRpcError as exc:  # not up yet, or still loading the model
                log.info("waiting for the scheduler", address=self.address,
                         code=exc.code().name)
                await asyncio.sleep(RECONNECT_DELAY_S)

    async def close(self) -> None:
        self._closed = True
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        if self._session_task is not None:
            self._session_task.cancel()
            try:
                await self._session_task
            except (asyncio.CancelledError, Exception):
                pass
        await self._channel.close()

    async def _run_sessions(self) -> None:
        while not self._closed:
            # each session may meet a restarted scheduler with other limits
            self.model_info = await self._fetch_model_info()
            outbox: asyncio.Queue = asyncio.Queue()
            call = self._stub.Session(_drain(outbox), wait_for_ready=True,
                                      metadata=self._metadata)
            try:
                await call.wait_for_connection()
                self._outbox = outbox
                self.connected.set()
                log.info("scheduler session open", address=self.address)
                if self._on_connection is not None:
                    await self._on_connection(True)
                async for response in call:
                    self._route(response)
            except grpc.aio.AioRpcError as exc:
                log.warning("scheduler session lost", code=exc.code().name,
                            details=exc.details())
            finally:
                self.connected.clear()
                self._outbox = None
                outbox.put_nowait(None)
                call.cancel()
                self._fail_all(EngineError(grpc.StatusCode.UNAVAILABLE,
                                           "the scheduler session was lost"))
                if self._on_connection is not None:
                    await self._on_connection(False)
            if not self._closed:
                await asyncio.sleep(RECONNECT_DELAY_S)

    # ---- requests

    def add(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 0, trace_context: dict[str, str] | None = None,
            cache_salt: str | None = None) -> asyncio.Queue[Item]:
        """Send a request; its outputs (or an EngineError) arrive on the queue."""
        if self._outbox is None:
            raise EngineError(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected")
        if req_id in self._queues:
            raise EngineError(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is running")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[req_id] = queue
        add = engine_pb2.AddRequest(
            request_id=req_id, prompt_token_ids=prompt_token_ids,
            sampling_params=convert.sampling_to_proto(params), priority=priority,
            arrival_unix_s=time.time(), trace_context=trace_context or {})
        if cache_salt is not None:
            add.cache_salt = cache_salt
        self._outbox.put_nowait(engine_pb2.EngineRequest(add=add))
        return queue

    def abort(self, req_ids: list[str]) -> int:
        """Abort at the scheduler; a reader still waiting gets a final ABORT output.
        Returns how many of the ids were still running here."""
        found = 0
        for req_id in req_ids:
            queue = self._queues.pop(req_id, None)
            if queue is not None:
                found += 1
                queue.put_nowait(RequestOutput(req_id, finish_reason=FinishReason.ABORT))
        if req_ids and self._outbox is not None:
            self._outbox.put_nowait(engine_pb2.EngineRequest(
                abort=engine_pb2.AbortRequests(request_ids=req_ids)))
        return found

    def release(self, req_id: str) -> None:
        """Forget a request that ended at the scheduler."""
        self._queues.pop(req_id, None)

    @property
    def num_active(self) -> int:
        return len(self._queues)

    def _route(self, response: engine_pb2.EngineResponse) -> None:
        for msg in response.outputs:
            queue = self._queues.get(msg.request_id)
            if queue is None:
                continue  # aborted here already; the scheduler had not seen it yet
            out = convert.request_output_from_proto(msg)
            queue.put_nowait(out)
            if out.finished:
                del self._queues[msg.request_id]
        for rejection in response.rejections:
            queue = self._queues.pop(rejection.request_id, None)
            if queue is not None:
                queue.put_nowait(EngineError.from_number(rejection.status.code,
                                                         rejection.status.message))

    def _fail_all(self, error: EngineError) -> None:
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(error)

    # ---- unary calls

    async def get_status(self, timeout_s: float = 5.0) -> engine_pb2.EngineStatus:
        try:
            return await self._stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=timeout_s,
                                              metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise EngineError(exc.code(), exc.details() or "GetStatus failed") from exc


async def _drain(outbox: asyncio.Queue) -> AsyncIterator[engine_pb2.EngineRequest]:
    while (item := await outbox.get()) is not None:
        yield item
