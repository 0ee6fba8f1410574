"""The engine loop: the one thread that drives the core Scheduler.

gRPC threads never touch the Scheduler: they check a request at the door, then
post commands (add, abort, close a session) to an inbox and return. The loop
takes the inbox between steps, runs schedule(), hands the step to the workers,
applies the result and routes each output to the session that owns the request.
It sleeps on a condition while there is nothing to do.

With async scheduling (the scheduler core's `async_scheduling`), up to two steps
are in flight: the loop schedules and submits step N+1, then collects step N, so
the scheduling decision and the RPC round trip happen while the worker computes.
Results are applied strictly in submission order, and each step's outputs go to
the frontends as soon as its result arrives. Without it, one step is in flight
(submit, then collect) and nothing else changes.

When the workers are lost the loop recovers by recomputation and reconnects
(scheduler_svc/engine_recovery.py).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from scheduler_svc.backoff import Backoff, BurstLog
from scheduler_svc.engine_recovery import WorkerLossRecovery
from scheduler_svc.engine_errors import (EngineFailed, ErrorCode, Failure, Overloaded,
                                      WorkerDisagreement, WorkerLost, describe)
from scheduler_svc.core.request import Request
from scheduler_svc.core.in_flight import WorkerOutputError
from shared.request_limits import token_ids_problem
from shared.types import (FinishReason, InvalidRequestError, ModelInfo,
                          ModelRunnerOutput, RequestOutput, SchedulerOutput)

log = structlog.get_logger("scheduler.engine")


class StepExecutor(Protocol):
    """The tensor-parallel worker group (or, in tests, a ModelRunner in-process)."""

    def submit(self, step: SchedulerOutput) -> None: ...

    def collect(self) -> ModelRunnerOutput:
        """The result of the oldest submitted step not collected yet (FIFO)."""
        ...


CLOSED = object()  # the last item of a session's outbox


@dataclass(slots=True, eq=False)
class Session:
    """One frontend's stream. The outbox holds lists of RequestOutput and Failure
    objects, then CLOSED."""

    session_id: int
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    closed: bool = False


@dataclass(slots=True)
class EngineCounters:
    num_steps: int = 0
    num_forward_passes: int = 0  # > num_steps when multi-step decode ran


class Engine(WorkerLossRecovery):
    """`telemetry` (scheduler_svc.metrics.SchedulerTelemetry) is called only from
    the loop thread, like the Scheduler."""

    def __init__(self, scheduler, executor: StepExecutor, model_info: ModelInfo,
                 max_model_len: int, *, telemetry=None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 on_serving: Callable[[bool], None] | None = None,
                 reconnect_timeout_s: float = 2.0) -> None:
        self._scheduler = scheduler
        self._executor = executor
        self.model_info = model_info
        self.max_model_len = max_model_len
        self._tel = telemetry
        self._on_failure = on_failure
        self._on_serving = on_serving  # flips the health status while workers are away
        self._reconnect_timeout_s = reconnect_timeout_s
        self.workers_connected = True
        self.num_worker_reconnects = 0
        self.num_worker_failovers = 0  # reconnects that landed on another group (a spare)
        self.worker_addresses: list[str] = list(getattr(executor, "addresses", []))
        if telemetry is not None and self.worker_addresses:
            telemetry.worker_group_active(self.worker_addresses)
        self.num_requests_recovered = 0
        self.num_worker_disagreements = 0  # answers refused as a worker fault (recovered)
        # doubles per failed round and per loss before any step was applied; reset by
        # an applied step (scheduler_svc/backoff.py)
        self._backoff = Backoff()
        self._progress = True  # a step was applied since the last reconnect
        self._lost_log = BurstLog()  # worker_lost lines of a loss loop
        self.num_reconnect_failures = 0  # failed reconnect rounds
        self.num_steps_failed = 0  # steps the workers answered with an error
        self.num_requests_failed = 0  # requests failed for breaking the workers
        self._cond = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._owners: dict[str, Session] = {}  # req_id -> session; guarded by _cond
        # max-num-seqs + --max-queued-requests: the one bound over every frontend's
        # requests (each frontend sees only its own); None = unbounded
        self.max_open_requests: int | None = None
        self._session_ids = itertools.count(1)
        self._sessions: set[Session] = set()
        self._stopping = False
        self.failed: BaseException | None = None
        self.counters = EngineCounters()
        # steps submitted and not collected, oldest first; the core allows two
        self._in_flight: deque[SchedulerOutput] = deque()
        self._depth = 2 if getattr(scheduler.config, "async_scheduling", False) else 1
        self.kv_events = None  # a publisher (scheduler_svc/kv_events.py) set by the server
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---------------------------------------------------------------- callers

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def open_session(self) -> Session:
        with self._cond:
            if self.failed is not None:
                raise EngineFailed(describe(self.failed))
            session = Session(next(self._session_ids))
            self._sessions.add(session)
            return session

    def close_session(self, session: Session) -> None:
        """The frontend went away: abort everything it owns."""
        with self._cond:
            if session.closed:
                return
            session.closed = True
            self._sessions.discard(session)
            ids = [r for r, s in self._owners.items() if s is session]
            for req_id in ids:
                del self._owners[req_id]
            self._post(("abort", ids))
            session.outbox.put(CLOSED)
            if self._tel is not None and ids:
                self._post(("call", lambda: [self._tel.request_finished(r, FinishReason.ABORT)
                                             for r in ids]))

    def add(self, session: Session, request: Request,
            trace_context: dict[str, str] | None = None) -> None:
        """Queue a request, or raise InvalidRequestError / KeyError (duplicate id) /
        Overloaded (the bound is reached) with nothing queued."""
        self.check(request)
        with self._cond:
            if self.failed is not None:
                raise EngineFailed(describe(self.failed))
            if session.closed:
                raise InvalidRequestError("the session is closed")
            if request.req_id in self._owners:
                raise KeyError(f"request id {request.req_id!r} is already running")
            if self.max_open_requests is not None and \
                    len(self._owners) >= self.max_open_requests:
                raise Overloaded(
                    f"the server is at capacity ({len(self._owners)} requests open at the "
                    f"scheduler over all frontends, limit {self.max_open_requests}); "
                    "retry later")
            self._owners[request.req_id] = session
            self._post(("add", (request, trace_context)))

    def abort(self, req_ids: list[str], session: Session | None = None) -> None:
        """Abort requests (only the session's own ones when a session is given);
        unknown or finished ids are ignored. Their outputs end with ABORT."""
        with self._cond:
            ids = [r for r in req_ids
                   if r in self._owners and (session is None or self._owners[r] is session)]
            if ids:
                self._post(("abort", ids))  # the loop sends each its ABORT output

    def check(self, request: Request) -> None:
        """The engine's door, the one validation behind the frontend's: everything that
        can be known about a request before queueing, with the sentence a gRPC client
        sees (INVALID_ARGUMENT). Every protocol's servicer reaches it through add();
        the core behind it only asserts."""
        info = self.model_info
        prompt = request.prompt_token_ids
        if not request.req_id:
            raise InvalidRequestError("request_id must not be empty")
        request.sampling_params.validate(info.vocab_size)
        problem = token_ids_problem(prompt, self.max_model_len, info.vocab_size,
                                    request.sampling_params.max_tokens)
        if problem is not None:  # the frontend's checks, asserted for any other client
            raise InvalidRequestError(problem)
        if request.sampling_params.num_output_prefix_tokens >= len(prompt):
            raise InvalidRequestError(
                f"num_output_prefix_tokens ({request.sampling_params.num_output_prefix_tokens}) "
                f"must be less than the prompt's {len(prompt)} tokens, of which it is the tail")
        need = len(prompt) + request.sampling_params.max_tokens
        # A request whose tokens cannot fit the whole KV pool would wait forever.
        blocks = -(-min(need, self.max_model_len) // info.block_size)
        if blocks > info.num_kv_blocks - 1:
            raise InvalidRequestError(
                f"prompt + max_tokens = {need} tokens need {blocks} KV blocks, but the "
                f"cache has only {info.num_kv_blocks - 1}")

    def post_failure(self, error: BaseException) -> None:
        """Something outside the loop saw the worker group break (e.g. an idle
        worker stream ended); the loop fails every request and stops."""
        with self._cond:
            self._post(("fail", error))

    def post_worker_lost(self, generation: int, error: BaseException) -> None:
        """A worker's Step stream ended outside a collect (e.g. while idle); the loop
        recovers unless it has already reconnected since (an older generation)."""
        with self._cond:
            self._post(("lost", (generation, error)))

    def num_sessions(self) -> int:
        with self._cond:
            return len(self._sessions)

    def run_on_loop(self, fn: Callable[[], object], timeout: float = 10.0):
        """Run fn on the engine thread between steps (the Scheduler is not
        thread-safe) and return its result: used for stats."""
        done = threading.Event()
        box: list = []

        def call() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box.append((False, e))
            done.set()

        with self._cond:
            if self.failed is not None or not self._thread.is_alive():
                return fn()  # nothing else touches the Scheduler any more
            self._post(("call", call))
        if not done.wait(timeout):
            raise TimeoutError("the engine loop did not answer")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    # ---------------------------------------------------------------- loop

    def _post(self, command: tuple) -> None:
        # caller holds _cond
        self._inbox.append(command)
        self._cond.notify()

    def _run(self) -> None:
        idle = False  # the last pass scheduled nothing and collected nothing
        try:
            while True:
                try:
                    idle = self._pass(idle)
                except WorkerLost as e:  # recompute everything on the reconnected workers
                    idle = False
                    if not self._recover(e):
                        return
                if idle is None:
                    return
        except BaseException as e:  # noqa: BLE001 - anything else ends the engine
            self._fail(e)

    def _pass(self, idle: bool) -> bool | None:
        """One pass of the loop; whether it was idle, or None when stopping."""
        with self._cond:
            while not self._stopping and not self._inbox and not self._in_flight \
                    and (idle or not self._scheduler.has_unfinished_requests()):
                self._cond.wait()
            if self._stopping:
                return None
            commands = list(self._inbox)
            self._inbox.clear()
        self._apply(commands)
        submitted = collected = False
        if len(self._in_flight) < self._depth and self._scheduler.has_unfinished_requests():
            submitted = self._submit_next()
        # Collect when the pipe is full, or when there was nothing more to send.
        if self._in_flight and (len(self._in_flight) >= self._depth or not submitted):
            self._collect_oldest()
            collected = True  # a result may free blocks or end a wait: schedule again
        return not submitted and not collected

    def _apply(self, commands: list[tuple]) -> None:
        failures: list[Failure] = []
        aborted: list[str] = []
        for command in commands:
            kind, arg = command
            if kind == "add":
                request, trace_context = arg
                try:
                    self._scheduler.add_request(request)
                except InvalidRequestError as e:
                    failures.append(Failure(request.req_id, ErrorCode.INVALID_ARGUMENT, str(e)))
                    continue
                if self._tel is not None:
                    self._tel.request_added(request.req_id, request.num_prompt_tokens,
                                            request.sampling_params, trace_context)
            elif kind == "abort":
                aborted.extend(arg)
            elif kind == "call":
                arg()
            elif kind == "fail":
                raise arg
            elif kind == "lost":
                generation, error = arg
                if generation == getattr(self._executor, "generation", generation):
                    raise error  # otherwise an older link's news: reconnected since
        ends = self._scheduler.abort_requests(aborted) if aborted else []
        if self._tel is not None and ends:
            self._tel.request_outputs(ends)
            self._tel.refresh(self._scheduler.stats())  # gauges read idle once all ended
        if failures or ends:
            self._route(ends, failures)

    def _submit_next(self) -> bool:
        """Schedule a step and hand it to the workers; False if it had nothing to
        compute and nothing to tell them (then nothing is sent)."""
        step = self._scheduler.schedule()
        if (not step.total_num_scheduled_tokens and not step.finished_req_ids
                and not step.preempted_req_ids and not step.grammar_compiles
                and not step.reset_requests and not self._grammar_poll()):
            return False
        tel = self._tel
        if tel is not None:
            step.trace_context = tel.step_scheduled(step, self._scheduler.stats())
            for new in step.scheduled_new_reqs:
                new.trace_context = tel.request_carrier(new.req_id)
        self._executor.submit(step)
        self._in_flight.append(step)
        return True

    def _grammar_poll(self) -> bool:
        """Send an empty step anyway: only deferred requests are left and only a
        worker's answer can say their grammars compiled (the worker holds an empty
        step until a compile ends or briefly; core/grammar_wait.py)."""
        grammar = getattr(self._scheduler, "grammar", None)
        return grammar is not None and not self._in_flight and grammar.needs_poll()

    def _grammar_failures(self) -> list[Failure]:
        """Requests ended because their grammar did not compile at the worker."""
        grammar = getattr(self._scheduler, "grammar", None)
        failed = grammar.take_failures() if grammar is not None else []
        if self._tel is not None:
            for req_id, _ in failed:
                self._tel.request_finished(req_id, FinishReason.ABORT)
        return [Failure(r, ErrorCode.INVALID_ARGUMENT, m) for r, m in failed]

    def _collect_oldest(self) -> None:
        """Apply the oldest in-flight step's result. Workers answer in submission
        order, so the result belongs to the head of _in_flight."""
        step = self._in_flight.popleft()
        tel = self._tel
        try:
            result = self._executor.collect()
        except BaseException:
            if tel is not None:
                for s in (step, *self._in_flight):
                    tel.step_finished(s.step_id, None)
            raise
        try:
            if result.step_id != step.step_id:
                raise WorkerOutputError(f"worker answered step {result.step_id} to step "
                                        f"{step.step_id}")
            if result.error:
                self._step_failed(step, result.error)
                return
            outputs = self._scheduler.update_from_output(step, result)
        except WorkerOutputError as e:  # nothing was applied: recompute, keep serving
            raise WorkerDisagreement(str(e), e.sides) from e
        self._backoff.reset()
        self._progress = True
        if self._lost_log.count:  # a step was applied: a burst of losses is over
            self._lost_log.end()
        self.counters.num_steps += 1
        self.counters.num_forward_passes += step.num_steps
        self._publish_kv_events()
        if tel is not None:
            tel.step_finished(step.step_id, result)
            tel.request_outputs(outputs)
            tel.refresh(self._scheduler.stats())  # gauges read idle once all ended
        self._route(outputs, self._grammar_failures())

    def _step_failed(self, step: SchedulerOutput, error: str) -> None:
        """The workers answered a step with an error: the core retries, isolates and
        fails (core/step_failure.py); the later steps in flight were skipped by the
        worker and are collected and dropped here, so answers stay in order."""
        tel = self._tel
        self.num_steps_failed += 1
        failed = self._scheduler.step_failed(step.step_id, error)
        self._publish_kv_events()  # AllBlocksCleared: every request is recomputed
        log.warning("step_failed", step_id=step.step_id, error=error,
                    requests=sorted(step.num_scheduled_tokens),
                    isolating=[r.req_id for r in self._scheduler.failures.suspects],
                    failed=[r for r, _ in failed])
        if tel is not None:
            tel.step_failed()
            tel.step_finished(step.step_id, None)
        self._fail_requests(failed, "step_failed")
        while self._in_flight:  # void: the worker skips them (or the stream ends: lost)
            later = self._in_flight.popleft()
            self._executor.collect()
            if tel is not None:
                tel.step_finished(later.step_id, None)
        if tel is not None:
            tel.refresh(self._scheduler.stats())

    def _fail_requests(self, failed: list[tuple[str, str]], cause: str) -> None:
        """End requests the core failed for breaking the workers: INTERNAL, with why."""
        if not failed:
            return
        self.num_requests_failed += len(failed)
        for req_id, message in failed:
            log.error("request_failed", req_id=req_id, cause=cause, error=message)
            if self._tel is not None:
                self._tel.request_failed(req_id, cause, message)
        self._route([], [Failure(r, ErrorCode.INTERNAL, m) for r, m in failed])

    def _publish_kv_events(self) -> None:
        # the prefix cache's changes since the last step; publish() never blocks
        if self.kv_events is not None:
            self.kv_events.publish(self._scheduler.kv.take_events())

    def _route(self, outputs: list[RequestOutput], failures: list[Failure]) -> None:
        by_session: dict[Session, list] = {}
        # Under the lock up to the puts, so a closing session sees all or nothing.
        with self._cond:
            for item in outputs + failures:
                session = self._owners.get(item.req_id)
                if session is None:
                    continue  # its session closed: the abort is already queued
                ended = isinstance(item, Failure) or item.finished
                if ended:
                    del self._owners[item.req_id]
                by_session.setdefault(session, []).append(item)
            for session, items in by_session.items():
                session.outbox.put(items)

    def _fail(self, error: BaseException) -> None:
        log.error("engine_failed", error=describe(error), error_type=type(error).__name__)
        with self._cond:
            self.failed = error
            failures = [Failure(r, ErrorCode.UNAVAILABLE, f"the engine failed: {describe(error)}")
                        for r in self._owners]
        self._route([], failures)
        # answer callers waiting on run_on_loop so they do not hang
        with self._cond:
            pending = [c for c in self._inbox if c[0] == "call"]
            self._inbox.clear()
        for _, call in pending:
            call()
        if self._on_failure is not None:
            self._on_failure(error)
