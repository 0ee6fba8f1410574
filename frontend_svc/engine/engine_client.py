"""The frontend's side of the scheduler: one long-lived bidirectional Session
stream that carries every request of this frontend (adds and aborts out, per-step
outputs back), routed to one asyncio queue per request.

Losing the session (the scheduler died or restarted) loses nothing here: each open
request keeps its prompt and the tokens streamed so far (its Choice; the
continuation rule is frontend_svc/engine/continuation.py)
and is re-submitted as a continuation once a new session opens, so the client's
stream just pauses. Under data parallelism (frontend_svc/engine/replicas.py) the
`on_lost` hook hands them to another replica instead (`take_open`, `adopt`).
Requests still waiting after RESUME_TIMEOUT_S end with UNAVAILABLE.
docs/resilience.md has the fault model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from shared.wire.common import model_info_from_proto
from shared.wire.engine import request_output_from_proto
from shared.grpc_server import CHANNEL_OPTIONS, COALESCE_BYTES
from shared.link_security import LinkSecurity
from shared.proto import common_pb2, engine_pb2, engine_pb2_grpc
from shared.telemetry import get_logger
from shared.types import FinishReason, ModelInfo, RequestOutput

from frontend_svc.telemetry import metrics
from frontend_svc.api.auth import scoped_cache_salt
from frontend_svc.engine import continuation
from frontend_svc.request.choice import Choice
from frontend_svc.errors import EngineError
from frontend_svc.engine.readiness import SchedulerHealth

log = get_logger(component="engine_client")
RECONNECT_DELAY_S = 0.5  # between attempts while the scheduler is away
MODEL_INFO_TIMEOUT_S = 30.0  # one attempt; the scheduler answers once its workers are up
RESUME_TIMEOUT_S = 120.0  # how long open requests wait for a lost scheduler to come back

Item = RequestOutput | EngineError


class EngineClient:
    def __init__(self, address: str,
                 on_connection: Callable[[bool], Awaitable[None]] | None = None,
                 model_name: str = "",
                 security: LinkSecurity | None = None,
                 on_lost: Callable[[EngineClient], None] | None = None) -> None:
        self.address = address
        self._on_connection = on_connection  # e.g. flips the health status
        self._on_lost = on_lost  # the session broke: may move open requests elsewhere
        security = security or LinkSecurity()  # TLS and the scheduler's internal token
        self._metadata = security.metadata
        self._channel = security.channel(address, CHANNEL_OPTIONS, aio=True)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._open: dict[str, Choice] = {}  # by the client's id, in arrival order
        self._wire: dict[str, Choice] = {}  # by the id the current scheduler knows
        self._resume_deadline: asyncio.TimerHandle | None = None
        self.num_resumed = 0  # requests re-submitted to a new scheduler session
        self._lost = metrics.SCHEDULER_SESSIONS_LOST.labels(model_name)
        self._resumed = metrics.REQUESTS_RESUMED.labels(model_name)
        self._batched = metrics.SESSION_BATCHED_REQUESTS.labels(model_name)
        self._outbox: asyncio.Queue[engine_pb2.EngineRequest | None] | None = None
        self._session_task: asyncio.Task | None = None
        self._closed = False
        self._refusing: EngineError | None = None  # set at the drain deadline
        self.connected = asyncio.Event()
        self.health = SchedulerHealth(self._channel, self._notify)
        self._health_task: asyncio.Task | None = None
        self.ever_ready = False  # liveness: /health fails until the stack was ready once
        self.model_info: ModelInfo | None = None

    # ---- lifecycle

    async def start(self) -> None:
        """Open the session (waiting for the scheduler); returns once connected."""
        self._session_task = asyncio.create_task(self._run_sessions())
        self._health_task = asyncio.create_task(self.health.run())
        await self.connected.wait()

    @property
    def ready(self) -> bool:
        """Readiness: a session is open and the scheduler holds its workers."""
        return self.model_info is not None and self.connected.is_set() and self.health.serving

    async def _notify(self) -> None:
        ready = self.ready
        self.ever_ready |= ready
        if self._on_connection is not None:
            await self._on_connection(ready)

    async def _fetch_model_info(self) -> ModelInfo:
        while True:
            try:
                reply = await self._stub.GetModelInfo(
                    common_pb2.GetModelInfoRequest(), wait_for_ready=True,
                    timeout=MODEL_INFO_TIMEOUT_S, metadata=self._metadata)
                return model_info_from_proto(reply)
            except grpc.aio.AioRpcError as exc:  # not up yet, or still loading the model
                log.info("waiting for the scheduler", address=self.address,
                         code=exc.code().name)
                await asyncio.sleep(RECONNECT_DELAY_S)

    async def close(self) -> None:
        self._closed = True
        if self._resume_deadline is not None:
            self._resume_deadline.cancel()
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        if self._health_task is not None:
            self._health_task.cancel()
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
            call = self._stub.Session(_drain(outbox, self._batched), wait_for_ready=True,
                                      metadata=self._metadata)
            try:
                await call.wait_for_connection()
                self._outbox = outbox
                self._resume_all(outbox)
                self.connected.set()
                log.info("scheduler session open", address=self.address)
                await self._notify()
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
                self._suspend_all()
                await self._notify()
            if not self._closed:
                await asyncio.sleep(RECONNECT_DELAY_S)

    # ---- requests

    def add(self, choice: Choice) -> asyncio.Queue[Item]:
        """Send a choice; its outputs (or an EngineError) arrive on the queue, and
        what the scheduler produced is recorded on the choice (Choice.seen). While a
        scheduler that was connected is away, the request is held and sent when a new
        session opens (a pause, not an error)."""
        req_id = choice.req_id
        if self._refusing is not None:  # shutting down: nothing new starts
            raise EngineError(self._refusing.code, self._refusing.message)
        if self._outbox is None and self.model_info is None:
            raise EngineError(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected")
        if req_id in self._queues:
            raise EngineError(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is running")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[req_id] = choice.queue = queue
        # salted with the caller's key (auth.py) here, so every path that adds is scoped
        choice.cache_salt = scoped_cache_salt(choice.inp.cache_salt)
        self._open[req_id] = choice
        if self._outbox is None:  # held for the next session
            self._arm_resume_deadline()
            return queue
        self._wire[req_id] = choice
        self._outbox.put_nowait(engine_pb2.EngineRequest(add=continuation.add_message(choice)))
        return queue

    def abort(self, req_ids: list[str]) -> int:
        """Abort at the scheduler; a reader still waiting gets a final ABORT output.
        Returns how many of the ids were still running here."""
        found = 0
        wire_ids = []
        for req_id in req_ids:
            open_ = self._forget(req_id)
            wire_ids.append(req_id if open_ is None else open_.wire_id)
            queue = self._queues.pop(req_id, None)
            if queue is not None:
                found += 1
                queue.put_nowait(RequestOutput(req_id, finish_reason=FinishReason.ABORT))
        if wire_ids and self._outbox is not None:
            self._outbox.put_nowait(engine_pb2.EngineRequest(
                abort=engine_pb2.AbortRequests(request_ids=wire_ids)))
        return found

    def release(self, req_id: str) -> None:
        """Forget a request that ended at the scheduler."""
        self._queues.pop(req_id, None)
        self._forget(req_id)

    def _forget(self, req_id: str) -> Choice | None:
        open_ = self._open.pop(req_id, None)
        if open_ is not None and self._wire.get(open_.wire_id) is open_:
            del self._wire[open_.wire_id]
        return open_

    def holds(self, req_id: str) -> bool:
        """Whether the request is open here (its outputs come through this client)."""
        return req_id in self._queues

    @property
    def num_active(self) -> int:
        return len(self._queues)

    def _route(self, response: engine_pb2.EngineResponse) -> None:
        for msg in response.outputs:
            open_ = self._wire.get(msg.request_id)
            queue = None if open_ is None else self._queues.get(open_.req_id)
            if queue is None:
                continue  # aborted here already; the scheduler had not seen it yet
            out = open_.seen(request_output_from_proto(msg))
            queue.put_nowait(out)
            if out.finished:
                del self._queues[open_.req_id]
                self._forget(open_.req_id)
        for rejection in response.rejections:
            open_ = self._wire.get(rejection.request_id)
            if open_ is None:
                continue
            self._forget(open_.req_id)
            queue = self._queues.pop(open_.req_id, None)
            if queue is not None:
                queue.put_nowait(EngineError.from_number(rejection.status.code,
                                                         rejection.status.message))

    def shutdown(self, error: EngineError) -> int:
        """The drain deadline: end every open request with `error` (a stream sends it
        as its last event, then [DONE]), abort them at the scheduler, and refuse
        later adds. Returns how many were open."""
        self._refusing = error
        if self._resume_deadline is not None:
            self._resume_deadline.cancel()
        wire_ids = [o.wire_id for o in self._open.values()]
        if wire_ids and self._outbox is not None:
            self._outbox.put_nowait(engine_pb2.EngineRequest(
                abort=engine_pb2.AbortRequests(request_ids=wire_ids)))
        count = len(self._queues)
        self._fail_all(error)
        return count

    def _fail_all(self, error: EngineError) -> None:
        self._resume_deadline = None
        queues, self._queues = self._queues, {}
        self._open.clear()
        self._wire.clear()
        for queue in queues.values():
            queue.put_nowait(error)

    # ---- scheduler loss (docs/resilience.md)

    def _suspend_all(self) -> None:
        """The session is gone: keep every open request for the next session, and
        give up on them if none opens in time."""
        self._wire.clear()
        self._lost.inc()
        if self._on_lost is not None:
            self._on_lost(self)
        if self._open:
            log.warning("scheduler lost; open requests wait for it", count=len(self._open),
                        resume_timeout_s=RESUME_TIMEOUT_S)
            self._arm_resume_deadline()

    def _arm_resume_deadline(self) -> None:
        if self._resume_deadline is None:
            self._resume_deadline = asyncio.get_running_loop().call_later(
                RESUME_TIMEOUT_S, self._fail_all, EngineError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the scheduler was lost and did not come back within "
                    f"{RESUME_TIMEOUT_S:g} s"))

    def take_open(self) -> list[Choice]:
        """Hand every open request over (data-parallel failover): this client forgets
        them. With the session still open (its scheduler lost its workers) they are
        aborted there first; what it still sends for them is dropped unrouted."""
        taken = list(self._open.values())
        if self._outbox is not None and taken:
            self._outbox.put_nowait(engine_pb2.EngineRequest(
                abort=engine_pb2.AbortRequests(request_ids=[o.wire_id for o in taken])))
        self._wire.clear()
        self._open.clear()
        self._queues.clear()
        if self._resume_deadline is not None:
            self._resume_deadline.cancel()
            self._resume_deadline = None
        return taken

    def adopt(self, open_: Choice) -> None:
        """Take over an open request of another replica: its continuation goes out on
        this session now (or with the next one), its queue stays the client's."""
        self._queues[open_.req_id] = open_.queue
        self._open[open_.req_id] = open_
        if self._outbox is None:
            self._arm_resume_deadline()
            return
        self._wire[continuation.next_wire_id(open_)] = open_
        self._outbox.put_nowait(engine_pb2.EngineRequest(add=continuation.add_message(open_)))

    def _resume_all(self, outbox: asyncio.Queue) -> None:
        """A new session: re-submit every open request as a continuation, in order."""
        if self._resume_deadline is not None:
            self._resume_deadline.cancel()
            self._resume_deadline = None
        for open_ in self._open.values():
            self._wire[continuation.next_wire_id(open_)] = open_
            outbox.put_nowait(engine_pb2.EngineRequest(add=continuation.add_message(open_)))
        if self._open:
            self.num_resumed += len(self._open)
            self._resumed.inc(len(self._open))
            log.info("open requests re-submitted to the scheduler", count=len(self._open))

    # ---- unary calls

    async def get_status(self, timeout_s: float = 5.0) -> engine_pb2.EngineStatus:
        try:
            return await self._stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=timeout_s,
                                              metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise EngineError(exc.code(), exc.details() or "GetStatus failed") from exc


async def _drain(outbox: asyncio.Queue, batched) -> AsyncIterator[engine_pb2.EngineRequest]:
    """The session's outgoing messages. What queued up while the last one was being
    written goes as one batch (up to COALESCE_BYTES): under load the event loop gets
    to this stream once per pass over all its streams, so a message per request
    would admit only a few requests a pass (1,000 arriving streams took ~20 s)."""
    while (item := await outbox.get()) is not None:
        if outbox.empty():
            yield item
            continue
        batch = engine_pb2.EngineRequests(requests=[item])
        size, closed = item.ByteSize(), False
        while size < COALESCE_BYTES and not outbox.empty():
            more = outbox.get_nowait()
            if more is None:
                closed = True
                break
            batch.requests.append(more)
            size += more.ByteSize()
        batched.inc(len(batch.requests) - 1)
        yield item if len(batch.requests) == 1 else engine_pb2.EngineRequest(batch=batch)
        if closed:
            return
