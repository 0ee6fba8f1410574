"""The scheduler service: the Engine gRPC API for frontends; the client side of
the Worker API (one Step stream per tensor-parallel rank, spare groups) is
scheduler_svc/worker_group.py.

    gapserve scheduler [flags]     (or python -m scheduler_svc.server)

The servicer is a thin translation between protobuf and the engine; the rules
live in scheduler_svc/core and the loop in scheduler_svc/engine.py.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Sequence

import grpc

from scheduler_svc.core.config import ConfigError, SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.metrics import REJECTED_FULL, SESSION_COALESCED_STEPS, SchedulerTelemetry
from scheduler_svc.engine import CLOSED, Engine, Session
from scheduler_svc.engine_errors import EngineFailed, ErrorCode, Failure, Overloaded, describe
from scheduler_svc.kv_events import KVEventsConfig, start_publisher
from scheduler_svc.vllm_engine import SERVICE_NAME as VLLM_ENGINE, VllmEngineServicer
from scheduler_svc.vllm_engine_kv import Fanout, KvEventStreams
from scheduler_svc.worker_group import WorkerGroup
from shared import config as flags
from shared.flag_spec import from_flags
from shared.wire.common import model_info_to_proto, sampling_from_proto
from shared.wire.engine import request_output_to_proto
from shared.wire.readout import message_from
from shared.arg_types import worker_groups
from shared.grpc_server import COALESCE_BYTES, ServiceServer
from shared.link_security import LinkSecurity, inner_bind_problem
from shared.ports import PortUnavailable, check_free
from shared.shutdown import stop_on_signals, wait_for_stop
from shared.proto import common_pb2, engine_pb2, engine_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2_grpc
from shared.speculative_config import parse_speculative_config
from shared.telemetry import get_logger, setup_telemetry, start_metrics_server
from shared.types import InvalidRequestError, ModelInfo

log = get_logger(service="scheduler")

_MAX_WAIT_S = 3600.0  # longest an early caller waits for start-up


# ---------------------------------------------------------------------------
# the Engine API


def _request_from_proto(msg: engine_pb2.AddRequest, eos_token_ids: list[int]) -> Request:
    return Request(
        msg.request_id, list(msg.prompt_token_ids),
        sampling_from_proto(msg.sampling_params), eos_token_ids,
        arrival_time=msg.arrival_unix_s or time.time(), priority=msg.priority,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None)


def _response(items: list, reply: engine_pb2.EngineResponse | None = None
              ) -> engine_pb2.EngineResponse:
    """One step's outputs and rejections, appended to `reply` (a new one if None)."""
    reply = engine_pb2.EngineResponse() if reply is None else reply
    for item in items:
        if isinstance(item, Failure):
            reply.rejections.add(request_id=item.req_id, status=common_pb2.Status(
                code=item.code.status_code.value[0], message=item.message))
        else:
            reply.outputs.append(request_output_to_proto(item))
    return reply


def coalesce(first: list, outbox: queue.SimpleQueue
             ) -> tuple[engine_pb2.EngineResponse, int, bool]:
    """The next message of a session: `first` (one step's items) and the steps that
    queued up behind it while the frontend read the last message, up to
    COALESCE_BYTES. Returns the message, how many steps it holds, and whether the
    session's CLOSED came after them. Sizes are measured only when steps did queue
    up: the usual message is one step's, sent as it is."""
    reply, steps, size = _response(first), 1, None
    while size is None or size < COALESCE_BYTES:
        try:
            items = outbox.get_nowait()
        except queue.Empty:
            break
        if items is CLOSED:
            return reply, steps, True
        part = _response(items)
        size = (reply.ByteSize() if size is None else size) + part.ByteSize()
        reply.MergeFrom(part)  # repeated fields: appended, in step order
        steps += 1
    return reply, steps, False

class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, status_fn=None) -> None:
        self.engine: Engine | None = None  # set by ready() once the workers answered
        self.status_fn = status_fn  # () -> engine_pb2.EngineStatus
        self._ready = threading.Event()

    def ready(self, engine: Engine, status_fn) -> None:
        self.engine, self.status_fn = engine, status_fn
        self._ready.set()

    def shutdown(self) -> None:
        self._ready.set()  # release callers still waiting for start-up

    def _engine(self, context) -> Engine:
        # Callers that come early wait (within their deadline) rather than fail, so a
        # frontend may start at the same time as the scheduler.
        # time_remaining() is huge (not None) without a deadline: Event.wait needs a bound
        if not self._ready.wait(min(context.time_remaining() or _MAX_WAIT_S, _MAX_WAIT_S)):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is still starting")
        engine = self.engine
        if engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        if engine.failed is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine failed: {describe(engine.failed)}")
        return engine

    def GetModelInfo(self, request, context):
        return model_info_to_proto(self._engine(context).model_info)

    def GetStatus(self, request, context):
        self._engine(context)
        return self.status_fn()

    def Session(self, request_iterator, context):
        engine = self._engine(context)
        session = engine.open_session()
        context.add_callback(lambda: engine.close_session(session))
        threading.Thread(target=self._read, args=(engine, session, request_iterator),
                         name=f"session-{session.session_id}", daemon=True).start()
        log.info("session_opened", session=session.session_id, peer=context.peer())
        coalesced = SESSION_COALESCED_STEPS.labels(engine.model_info.model_name)
        while True:
            items = session.outbox.get()
            if items is not CLOSED:
                reply, steps, closed = coalesce(items, session.outbox)
                coalesced.inc(steps - 1)
                yield reply
            if items is CLOSED or closed:
                log.info("session_closed", session=session.session_id)
                return

    def _read(self, engine: Engine, session: Session, request_iterator) -> None:
        eos = engine.model_info.eos_token_ids
        try:
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "batch":
                    self._handle(engine, session, msg, eos)
                    continue
                for item in msg.batch.requests:
                    if item.WhichOneof("kind") == "batch":
                        log.warning("nested_batch_skipped", session=session.session_id)
                    else:
                        self._handle(engine, session, item, eos)
        except grpc.RpcError:
            pass  # the frontend went away; closing below aborts its requests
        finally:
            engine.close_session(session)

    @classmethod
    def _handle(cls, engine: Engine, session: Session, msg: engine_pb2.EngineRequest,
                eos) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "add":
            cls._add(engine, session, msg.add, eos)
        elif kind == "abort":
            engine.abort(list(msg.abort.request_ids), session)

    @staticmethod
    def _add(engine: Engine, session: Session, msg: engine_pb2.AddRequest, eos) -> None:
        try:
            engine.add(session, _request_from_proto(msg, eos), dict(msg.trace_context))
        except InvalidRequestError as e:
            session.outbox.put([Failure(msg.request_id, ErrorCode.INVALID_ARGUMENT, str(e))])
        except KeyError as e:
            session.outbox.put([Failure(msg.request_id, ErrorCode.ALREADY_EXISTS, e.args[0])])
        except EngineFailed as e:
            session.outbox.put([Failure(msg.request_id, ErrorCode.UNAVAILABLE, str(e))])
        except Overloaded as e:
            REJECTED_FULL.inc()
            session.outbox.put([Failure(msg.request_id, ErrorCode.RESOURCE_EXHAUSTED, str(e))])


def engine_status(engine: Engine, scheduler: Scheduler,
                  telemetry: SchedulerTelemetry) -> engine_pb2.EngineStatus:
    """Stats and diagnosis, read on the loop thread between steps."""
    stats, diag = engine.run_on_loop(
        lambda: (lambda st: (st, telemetry.status(st)))(scheduler.stats()))
    # By name from the stats (num_running, prefix_cache_hits, the spec_* counters, ...)
    # and the diagnosis (max_num_seqs, window_s, diagnosis, summary, lever, ...); by
    # keyword what they name otherwise or the engine holds.
    return message_from(
        engine_pb2.EngineStatus, stats, diag,
        num_waiting=diag["waiting"],  # waiting for capacity: stats.num_waiting also
        # counts the requests not ready (a grammar compiling), sent apart
        kv_cache_usage=stats.kv_usage, num_kv_blocks=stats.num_total_blocks,
        num_preemptions_in_window=diag["preemptions_in_window"],
        num_steps_total=engine.counters.num_steps,
        num_forward_passes_total=engine.counters.num_forward_passes,
        num_sessions=engine.num_sessions(), worker_addresses=",".join(engine.worker_addresses),
        num_worker_reconnects_total=engine.num_worker_reconnects,
        num_worker_failovers_total=engine.num_worker_failovers,
        speculative_config=engine.model_info.speculative_config)


def flush_prefix_cache(engine: Engine, scheduler: Scheduler) -> None:
    """Forget every prefix-cache entry (running requests keep their blocks), on the
    loop between steps, and tell KV event subscribers at once."""
    def flush() -> None:
        scheduler.kv.pool.forget_cached()
        if engine.kv_events is not None:
            engine.kv_events.publish(scheduler.kv.take_events())
    engine.run_on_loop(flush)


# ---------------------------------------------------------------------------
# start-up


def scheduler_config(args, info: ModelInfo) -> SchedulerConfig:
    """SchedulerConfig from the scheduler's flags (shared/flag_spec.from_flags: a flag
    and a field of the same name are one setting) and the workers' facts: the block
    size, and what an unset flag falls back to (their max_model_len and the step
    budget they profiled their memory with, the handshake having checked the flag)."""
    if args.max_model_len is not None and args.max_model_len > info.max_model_len:
        raise ConfigError(f"--max-model-len {args.max_model_len} exceeds the worker's "
                          f"max_model_len {info.max_model_len}")
    facts = {"block_size": info.block_size, "max_model_len": info.max_model_len,
             # the workers' --speculative-config: they propose and verify, the scheduler
             # gives the slots (one flag, one owner; docs/spec_decode.md)
             "speculative_config": parse_speculative_config(info.speculative_config),
             # the model's window and longrope threshold: the worker's facts
             "sliding_window": info.sliding_window,
             "long_prompt_rope_from": info.long_prompt_rope_from}
    if info.max_num_batched_tokens:
        facts["max_num_batched_tokens"] = info.max_num_batched_tokens
    cfg = from_flags(SchedulerConfig, args, flags.SchedulerFlags,
                     renames={"policy": "scheduling_policy"}, unset=facts)
    cfg.validate()
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    args = flags.parse_args(flags.scheduler_parser(), argv)
    setup_telemetry("scheduler", otlp_endpoint=args.otlp_traces_endpoint,
                    log_format=args.log_format, log_level=args.log_level)
    stop = stop_on_signals()
    servicer = EngineServicer()
    security = LinkSecurity.from_args(args)
    if (problem := inner_bind_problem(args.host, security, args.allow_insecure_inner)):
        log.error("insecure_bind_refused", host=args.host)
        print(f"gapserve scheduler: {problem}", file=sys.stderr)
        return 2
    server = ServiceServer(security=security, instance_id=args.instance_id)
    server.add(engine_pb2_grpc.add_EngineServicer_to_server, servicer, "gapserve.v1.Engine")
    # the ecosystem's engine protocol, for gateways such as smg (scheduler_svc/vllm_engine.py)
    vllm_servicer = VllmEngineServicer()
    server.add(vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server, vllm_servicer, VLLM_ENGINE)
    try:  # every port before anything is announced
        kv_events_cfg = KVEventsConfig.from_json(args.kv_events_config)
        for host, kv_port in kv_events_cfg.listen_ports():
            check_free(host, kv_port, "--kv-events-config")
        check_free(args.host, args.metrics_port, "--metrics-port")
        port = server.start(args.host, args.port)
        if args.metrics_port:
            start_metrics_server(args.metrics_port, args.host)
    except (PortUnavailable, ConfigError) as e:
        print(f"gapserve scheduler: {e}", file=sys.stderr)
        server.stop(0)  # when the metrics port was taken since its check
        return 2
    log.info("scheduler_listening", port=port, workers=list(args.worker_addresses),
             spares=worker_groups(args.worker_addresses)[1:])
    group = WorkerGroup(args.worker_addresses, step_timeout_s=args.step_timeout_s or None,
                        security=security)
    engine = kv_events = None
    failed = threading.Event()
    try:
        info = _handshake(group, stop, args.max_num_batched_tokens)
        if info is None:
            return 0
        cfg = scheduler_config(args, info)
        scheduler = Scheduler(cfg, info.num_kv_blocks)
        spec = cfg.speculative_config
        telemetry = SchedulerTelemetry(info.model_name, cfg.max_num_seqs,
                                       cfg.max_num_batched_tokens,
                                       spec.num_speculative_tokens if spec else 0)
        if spec is not None:
            log.info("speculative_decoding", config=spec.to_json())
        engine = Engine(scheduler, group, info, cfg.max_model_len, telemetry=telemetry,
                        on_failure=lambda e: (failed.set(), stop.set()),
                        on_serving=server.set_serving)
        engine.max_open_requests = cfg.max_num_seqs + args.max_queued_requests
        # the ZMQ publisher (--kv-events-config) and the VllmEngine SubscribeKvEvents streams
        kv_streams = KvEventStreams(info.block_size, info.model_name, start_recording=lambda:
                                    engine.run_on_loop(scheduler.kv.record_events))
        engine.kv_events = kv_events = Fanout(
            start_publisher(kv_events_cfg, scheduler.kv, info.block_size, info.model_name),
            kv_streams)
        group.open_streams(on_lost=engine.post_worker_lost)
        engine.start()
        status = lambda: engine_status(engine, scheduler, telemetry)  # noqa: E731
        servicer.ready(engine, status)
        vllm_servicer.ready(engine, status, lambda: flush_prefix_cache(engine, scheduler),
                            kv_streams, cfg.max_num_seqs)
        server.set_serving()
        log.info("scheduler_ready", model=info.model_name, num_kv_blocks=info.num_kv_blocks,
                 block_size=info.block_size, max_model_len=cfg.max_model_len,
                 sliding_window=cfg.sliding_window, max_num_seqs=cfg.max_num_seqs,
                 max_num_batched_tokens=cfg.max_num_batched_tokens,
                 max_open_requests=engine.max_open_requests)
        wait_for_stop(stop)
        if not failed.is_set():
            _drain(engine, scheduler, server, args.drain_timeout_s)
    except ConfigError as e:
        log.error("bad_configuration", error=str(e))
        print(f"gapserve scheduler: {e}", file=sys.stderr)
        return 2
    finally:
        servicer.shutdown()
        vllm_servicer.shutdown()
        server.stop(grace_s=2.0)
        if engine is not None:
            engine.stop()
        if kv_events is not None:
            kv_events.close()
        group.close()
    return 1 if failed.is_set() else 0


def _drain(engine: Engine, scheduler: Scheduler, server: ServiceServer,
           timeout_s: float) -> None:
    """SIGTERM: report NOT_SERVING (frontends see it and stop routing new work) and let
    what is running finish, for at most timeout_s. Requests still open then are
    handed back: their frontends re-submit them to the next scheduler."""
    server.set_serving(False)
    deadline = time.monotonic() + timeout_s
    left = engine.run_on_loop(scheduler.get_num_unfinished_requests)
    log.info("draining", unfinished=left, drain_timeout_s=timeout_s)
    pause = threading.Event()
    while left and time.monotonic() < deadline and engine.failed is None:
        pause.wait(0.05)  # shutdown only: a short poll of the loop is enough
        left = engine.run_on_loop(scheduler.get_num_unfinished_requests)
    log.info("drained", unfinished=left, handed_back=left)


def _handshake(group: WorkerGroup, stop: threading.Event,
               max_num_batched_tokens: int | None = None) -> ModelInfo | None:
    """Retry until every worker answers (they load the model first) or we are told to stop."""
    while not stop.is_set():
        try:
            return group.handshake(timeout_s=2.0, max_num_batched_tokens=max_num_batched_tokens)
        except grpc.RpcError as e:
            # CANCELLED: the worker stopped its server mid-call (it refused its model and
            # exits); that is the worker's failure to report, not this scheduler's
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                                grpc.StatusCode.CANCELLED):
                raise ConfigError(f"worker handshake failed: {e.code().name}: {e.details()}")
            log.debug("waiting_for_workers", addresses=group.addresses)
    return None


if __name__ == "__main__":
    sys.exit(main())
