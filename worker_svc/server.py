"""The worker service: a Handshake that reports the model and the KV pool, then
one Step stream whose steps run strictly in the order they arrive.

    gapserve worker [flags]     (or python -m worker_svc.server)

The servicer is a thin translation between protobuf and worker_svc.runner.ModelRunner.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Sequence

import grpc

from shared import config as flags
from shared.flag_spec import from_flags
from shared.wire.common import model_info_to_proto
from shared.wire.readout import message_from
from shared.wire.worker import runner_output_to_proto, scheduler_output_from_proto
from shared.grpc_server import ServiceServer
from shared.link_security import LinkSecurity, inner_bind_problem
from shared.instance import SCHEDULER_HEADER
from shared.ports import PortUnavailable, check_free
from shared.shutdown import stop_on_signals, wait_for_stop
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.telemetry import get_logger, setup_telemetry, start_metrics_server
from shared.types import ModelRunnerOutput, SchedulerOutput
from worker_svc import compute
from worker_svc.config import WorkerConfig
from worker_svc.parallel import GroupLost

log = get_logger(service="worker")

# longest a new Step stream from another (or an unnamed) scheduler waits for the one
# before it to end: under the scheduler's reconnect wait (2 s), so a live other
# scheduler's stream is refused by name first. The same scheduler reconnecting is
# handed the worker as soon as its old stream has ended, which the worker then ends.
STREAM_HANDOVER_S = 1.0


def describe_error(error: BaseException) -> str:
    """The exception in one line for the scheduler and the client: type and message."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__

_END = object()  # the last item of a pipe's queues


class StepFailed:
    """A step could not be read (the reader hands it on), or the tensor-parallel group
    was lost or the process is exiting while running it (the stream ends with it,
    nothing later runs)."""

    __slots__ = ("step_id", "error")

    def __init__(self, step_id: int, error: BaseException) -> None:
        self.step_id = step_id
        self.error = error


class StepPipe:
    """Steps of one stream, executed strictly in arrival order on the process's
    compute thread (worker_svc.compute).

    Correctness rests on that order: the scheduler may hand a block freed by one
    request to another while a step that writes the old owner's KV is still in
    flight, and it sends step N+1 before it has seen step N's sampled tokens. Both
    are safe only because step N has finished here, KV writes and sampled tokens
    (kept on the device for N+1's input) included, before step N+1 starts."""

    def __init__(self, runner) -> None:
        self.runner = runner
        # SchedulerOutput (or StepFailed if one could not be read), then _END
        self.steps: queue.SimpleQueue = queue.SimpleQueue()
        # (step, ModelRunnerOutput) or (step or None, StepFailed), then _END
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._executing = None  # the Future of _execute_all on the compute thread

    def start(self, request_iterator) -> None:
        threading.Thread(target=self._read, args=(request_iterator,), name="step-reader",
                         daemon=True).start()
        self._executing = compute.submit(self._execute_all)

    def stop(self) -> None:
        self._stopping.set()
        self.steps.put(_END)
        if self._executing is not None:
            self._executing.result()  # the step being computed ends; none after it starts

    def _read(self, request_iterator) -> None:
        try:
            for msg in request_iterator:
                try:
                    step = scheduler_output_from_proto(msg)
                except Exception as e:  # noqa: BLE001 - a malformed step fails as a step
                    self.steps.put(StepFailed(msg.step_id, e))
                    continue
                self.steps.put(step)
        except grpc.RpcError:
            pass  # the scheduler went away; the stream ends below
        finally:
            self.steps.put(_END)

    def _execute_all(self) -> None:
        last_end = None  # perf_counter when the previous step ended
        held = []  # the previous step's (step, result), not yet handed to the sender

        def hand_over() -> None:
            if held:
                self.results.put(held.pop())

        failed_at = None  # the step that failed; later ones are skipped until a reset
        while (step := self.steps.get()) is not _END and not self._stopping.is_set():
            if isinstance(step, StepFailed):  # could not be read
                hand_over()
                failed_at = self._failed(None, step.step_id, step.error)
                continue
            if failed_at is not None and not step.reset_requests:
                # built on the failed step's state (async: sent before the scheduler knew)
                hand_over()
                self.results.put((None, ModelRunnerOutput(
                    step_id=step.step_id, step_skipped=True,
                    error=f"not run: step {failed_at} failed before it")))
                continue
            failed_at = None  # a reset step: the runner drops every request first
            start = time.perf_counter()
            try:
                # The previous result goes to the sender once this step's inputs are
                # built: the sender's Python (protobuf, metrics, gRPC) then runs while
                # the forward pass is in C without the GIL, not against the input
                # preparation, which it slowed from ~0.4 to 1.6-1.8 ms a step in the stack.
                result = self.runner.execute(step, on_prepared=hand_over)
            except GroupLost as e:  # the process exits (see main): the stream ends
                hand_over()
                self.results.put((step, StepFailed(step.step_id, e)))
                break
            except Exception as e:  # noqa: BLE001 - reported as data; the stream goes on
                hand_over()
                failed_at = self._failed(step, step.step_id, e)
                continue
            except BaseException as e:  # noqa: BLE001 - interpreter exit: the stream ends
                hand_over()
                self.results.put((step, StepFailed(step.step_id, e)))
                break
            hand_over()  # a step that prepared nothing (only finished requests)
            # idle: from the end of the previous step to the start of this one, so it
            # counts waiting for the scheduler (or for any work, when the server is quiet)
            result.timings.idle_ms = 0.0 if last_end is None else (start - last_end) * 1e3
            last_end = time.perf_counter()
            held.append((step, result))
            if self.steps.empty():  # no next step to prepare: do not sit on this one
                hand_over()
            self.runner.after_step()  # fault injection in drills, else nothing
        hand_over()
        self.results.put(_END)

    def _failed(self, step, step_id: int, error: BaseException) -> int:
        """A step raised (or could not be read): answer it with the error and drop
        every request, whose state it may have half changed; the scheduler retries
        or isolates (docs/resilience.md, "A request that fails by itself")."""
        dropped = self.runner.drop_requests()
        log.error("step_failed", step_id=step_id, error=describe_error(error),
                  error_type=type(error).__name__, requests_dropped=dropped,
                  exc_info=error)
        self.results.put((step, ModelRunnerOutput(step_id=step_id,
                                                  error=describe_error(error))))
        return step_id


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, rank: int, tensor_parallel_size: int) -> None:
        self.rank = rank
        self.tensor_parallel_size = tensor_parallel_size
        self.runner = None  # set once the model is loaded
        self.telemetry = None  # worker_svc.metrics.WorkerTelemetry
        # One scheduler drives a worker: a second Step stream would interleave steps.
        self._stream_lock = threading.Lock()
        # the stream holding it: its scheduler's id (shared/instance.py) and context
        self._holder: tuple[str | None, object] | None = None

    def _runner(self, context):
        if self.runner is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading the model")
        return self.runner

    def Handshake(self, request, context):
        runner = self._runner(context)
        tp = request.tensor_parallel_size
        if tp and tp != self.tensor_parallel_size:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this worker is rank {self.rank} of a group of "
                          f"{self.tensor_parallel_size}, the scheduler expects {tp}")
        budget = request.max_num_batched_tokens
        if budget and budget != runner.max_num_batched_tokens:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the scheduler's --max-num-batched-tokens is {budget}, but this "
                          f"worker sized its memory for steps of "
                          f"{runner.max_num_batched_tokens} tokens; give both services the "
                          f"same --max-num-batched-tokens")
        # rank and tensor_parallel_size by name from this servicer
        return message_from(worker_pb2.HandshakeResponse, self,
                            model_info=model_info_to_proto(runner.model_info()))

    def Step(self, request_iterator, context):
        """Three threads per stream: a reader takes steps off the wire as they come
        (step N+1 usually arrives while step N computes), one thread executes them,
        and this handler sends each result once the next step's inputs are built (at
        once when no next step is waiting), so neither reading nor sending ever sits
        between two steps."""
        runner = self._runner(context)
        if not self._take_stream(context):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "another scheduler already drives this worker")
        context.send_initial_metadata(())  # tells the scheduler it has the stream
        pipe = StepPipe(runner)
        try:
            log.info("step_stream_opened", peer=context.peer())
            pipe.start(request_iterator)
            while (item := pipe.results.get()) is not _END:
                step, result = item
                if isinstance(result, StepFailed):  # GroupLost (the process exits: main)
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"rank {self.rank}: step {result.step_id}: {result.error}")
                if result.error:  # a failed or skipped step travels as data
                    if self.telemetry is not None and not result.step_skipped:
                        self.telemetry.step_failed()
                    yield runner_output_to_proto(result)
                    continue
                if self.telemetry is not None:
                    self.telemetry.step(step, result.timings)
                    self.telemetry.argmax_screen(self.runner.model.screen_rows)
                    self.telemetry.expert_tokens(getattr(self.runner.model, "expert_tokens", None))
                if self.rank != 0:  # all ranks run the step; rank 0 answers with tokens
                    result = ModelRunnerOutput(step_id=result.step_id, timings=result.timings)
                yield runner_output_to_proto(result)
            log.info("step_stream_closed")
        finally:
            try:
                pipe.stop()  # waits for the step being computed, runs no further one
                self._forget_all(runner)
            finally:
                self._holder = None
                self._stream_lock.release()

    def _take_stream(self, context) -> bool:
        """Whether this Step stream now drives the worker. The scheduler that holds it
        reconnecting (it ended its old stream, whose end may not have reached this
        worker yet) gets it once that stream has ended: the worker ends it too, and the
        wait lasts while the new stream is open (a step being computed finishes
        first). Another scheduler's live stream keeps it: refused after
        STREAM_HANDOVER_S."""
        caller = dict(context.invocation_metadata() or ()).get(SCHEDULER_HEADER)
        if self._stream_lock.acquire(blocking=False):
            self._holder = (caller, context)
            return True
        holder = self._holder
        if caller is None or holder is None or caller != holder[0]:
            if not self._stream_lock.acquire(timeout=STREAM_HANDOVER_S):
                return False
        else:
            log.info("step_stream_superseded", scheduler=caller)
            holder[1].cancel()  # its reader and sender stop; its handler releases the lock
            while not self._stream_lock.acquire(timeout=0.1):
                if not context.is_active():  # the reconnecting scheduler gave up
                    return False
        self._holder = (caller, context)
        return True

    def drain(self, server, timeout_s: float) -> None:
        """SIGTERM: NOT_SERVING, then keep executing steps while a scheduler still
        streams them (it is draining its running requests), for at most timeout_s."""
        server.set_serving(False)
        if self._stream_lock.acquire(timeout=timeout_s):
            self._stream_lock.release()
            log.info("drained")
        else:
            log.info("drain_timeout", drain_timeout_s=timeout_s)

    @staticmethod
    def _forget_all(runner) -> None:
        """The scheduler that owned these requests is gone; a new one starts afresh,
        so drop every request through the ordinary increment: a finishing step."""
        held = set(runner.requests)
        if not held:
            return
        try:
            compute.run(runner.execute, SchedulerOutput(step_id=-1, finished_req_ids=held))
        except compute.ComputeThreadStopped:  # the process is exiting: they go with it
            log.info("requests_not_dropped_at_exit", count=len(held))
            return
        log.info("requests_dropped", count=len(held))


def worker_config(args) -> WorkerConfig:
    """WorkerConfig from the worker's flags (shared/flag_spec.from_flags): a flag and a
    field of the same name are one setting; an unset flag keeps the field's default."""
    cfg = from_flags(
        WorkerConfig, args, flags.WorkerFlags, renames={"tensor_parallel_rank": "rank"},
        unset={  # torchrun's variables are accepted after the flag and GAPSERVE_MASTER_*
            "master_addr": os.environ.get("MASTER_ADDR") or "127.0.0.1",
            "master_port": int(os.environ.get("MASTER_PORT") or 29500),
            "fault_stop_after_steps": flags.fault_stop_after_steps(),
            "fault_fail_on_token": flags.fault_fail_on_token()})
    cfg.validate()
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    parser = flags.worker_parser()
    args = flags.parse_args(parser, argv)
    if args.rank >= args.tensor_parallel_size:
        parser.error(f"--rank {args.rank} must be below --tensor-parallel-size "
                     f"{args.tensor_parallel_size}")
    try:
        cfg = worker_config(args)
    except ValueError as e:
        parser.error(str(e))
    setup_telemetry(f"worker-{args.rank}", otlp_endpoint=args.otlp_traces_endpoint,
                    log_format=args.log_format, log_level=args.log_level)
    stop = stop_on_signals()
    security = LinkSecurity.from_args(args)
    if (problem := inner_bind_problem(args.host, security, args.allow_insecure_inner)):
        log.error("insecure_bind_refused", host=args.host)
        print(f"gapserve worker: {problem}", file=sys.stderr)
        return 2
    servicer = WorkerServicer(args.rank, args.tensor_parallel_size)
    server = ServiceServer(security=security, instance_id=args.instance_id)
    server.add(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "gapserve.v1.Worker")
    metrics_port = 8002 + args.rank if args.metrics_port is None else args.metrics_port
    try:  # both ports before anything is announced or loaded
        check_free(args.host, metrics_port, "--metrics-port")
        port = server.start(args.host, 50053 + args.rank if args.port is None else args.port)
        if metrics_port:
            start_metrics_server(metrics_port, args.host)
    except PortUnavailable as e:
        print(f"gapserve worker: {e}", file=sys.stderr)
        server.stop(0)  # when the metrics port was taken since its check
        return 2
    log.info("worker_listening", port=port, rank=args.rank, metrics_port=metrics_port)
    try:
        from shared.structured import compile_cache
        from worker_svc.metrics import WEIGHT_BYTES, WorkerTelemetry
        from worker_svc.runner import ModelRunner

        # a compile running past the bound no longer holds a compile thread
        compile_cache.CACHE.stuck_after_s = cfg.structured_outputs_compile_timeout_s

        # loads the weights and sizes the KV pool, on the thread that will run the steps
        runner = compute.run(ModelRunner, cfg)
        group_lost = _watch_group(runner, stop)
        info = runner.model_info()
        servicer.telemetry = WorkerTelemetry(info.model_name, args.rank)
        WEIGHT_BYTES.labels(info.model_name, str(args.rank)).set(runner.weight_bytes)
        servicer.runner = runner
        server.set_serving()
        log.info("worker_ready", model=info.model_name, num_kv_blocks=info.num_kv_blocks,
                 block_size=info.block_size, max_model_len=info.max_model_len, dtype=info.dtype,
                 compute_plan=info.compute_plan)
        wait_for_stop(stop)
        servicer.drain(server, args.drain_timeout_s)
    except (ValueError, FileNotFoundError) as e:
        log.error("worker_failed_to_start", error=str(e))
        print(f"gapserve worker: {e}", file=sys.stderr)
        return 2
    finally:
        server.stop(grace_s=2.0)
    if group_lost.is_set():
        # fail-stop: the compute thread may be stuck in a collective that never ends,
        # so leave without joining it; a restarted rank set forms a new group
        print(f"gapserve worker: rank {args.rank}: the tensor-parallel group is lost; "
              "exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_GROUP_LOST)
    return 0


EXIT_GROUP_LOST = 3


def _watch_group(runner, stop: threading.Event) -> threading.Event:
    """An event set when this rank's tensor-parallel group is lost; it also stops the
    process, whose Step stream then ends like a dead worker's."""
    lost = threading.Event()
    if runner.tp is None:
        return lost

    def on_lost(_reason: str) -> None:
        lost.set()
        stop.set()

    runner.tp.on_lost = on_lost
    if runner.tp.lost:  # lost while the model was loading
        on_lost("")
    return lost


if __name__ == "__main__":
    sys.exit(main())
