"""`gapserve serve`: worker(s), scheduler and frontend as processes on one machine.

With --data-parallel-size N it runs N replicas, each its own scheduler and worker
ranks on its own ports (replica i: every inner port + i x --data-parallel-port-stride)
and, for kv-aware routing, its own KV event publisher; the frontend(s) hold a
session to every replica and route between them (frontend_svc/engine/replicas.py).

Checks every port first (a busy one is one line naming it and its flag), starts
them together (the frontend loads its tokenizer while the worker loads the model),
waits until every one answers grpc.health.v1 SERVING for this start's instance id
(so never another server on the same ports), prints where to connect, restarts any
that dies with backoff (the others carry on: docs/resilience.md) until one keeps
dying, and stops all of them on Ctrl-C/SIGTERM. When it stops on a failure, the last
line it prints is the failed child's own: its refusal (gapserve/supervisor.py).
"""

from __future__ import annotations

import argparse
import atexit
import copy
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from gapserve.supervisor import Child, Supervisor
from shared import config as flags
from shared.flag_spec import forwarded, secrets_env
from shared.instance import new_instance_id
from shared.link_security import LinkSecurity, inner_bind_problem
from shared.ports import PortUnavailable, check_free


def serve_parser() -> argparse.ArgumentParser:
    return flags.serve_parser()


def _loopback(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host




def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _metrics_dir() -> str:
    """A fresh directory for the frontends' multiprocess metrics (removed at exit):
    files of a frontend that died stay, so its counts are not lost from the sums."""
    path = tempfile.mkdtemp(prefix="gapserve-frontend-metrics-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@dataclass(slots=True)
class Replica:
    """One data-parallel replica's processes and where the frontend finds them."""

    children: list[Child]
    scheduler_address: str
    kv_endpoint: str | None = None  # its KV event publisher, as the frontend dials it
    replay_endpoint: str | None = None


def _nice_env(args: argparse.Namespace) -> dict[str, str]:
    """The scheduler's and frontend's niceness (--helper-nice; gapserve/cli.py applies
    it): a CPU worker's decode step shares the machine's cores with them, and every
    slice they take from its OpenMP threads stalls the step at its next barrier; on a
    machine of the stack's own they should take only what the step leaves."""
    nice = getattr(args, "helper_nice", 0)
    return {flags.NICE_ENV: str(nice)} if nice else {}


def children(args: argparse.Namespace) -> list[Child]:
    host = _loopback(args.inner_host)
    security = LinkSecurity.from_args(args)
    size = getattr(args, "data_parallel_size", 1)
    replicas = [_replica(args, i, size, host, security) for i in range(size)]
    front = _loopback(args.host)
    scheme = "https" if args.ssl_certfile else "http"
    # --api-server-count N: N frontends on the same ports; the kernel spreads connections
    count = getattr(args, "api_server_count", 1)
    front_env = {**secrets_env(args, flags.FrontendFlags), **_nice_env(args)}
    if count > 1:  # a scrape reaches one: it sums all (frontend_svc/telemetry/vllm_metrics.py)
        front_env["PROMETHEUS_MULTIPROC_DIR"] = _metrics_dir()
    if size == 1:
        upstream = ["--scheduler-address", replicas[0].scheduler_address]
    else:
        upstream = ["--scheduler-addresses", ",".join(r.scheduler_address for r in replicas)]
        if all(r.kv_endpoint for r in replicas):
            upstream += ["--kv-events-endpoints", ",".join(r.kv_endpoint for r in replicas),
                         "--kv-events-replay-endpoints",
                         ",".join(r.replay_endpoint for r in replicas)]
    frontends = [Child(
        "frontend" if count == 1 else f"frontend-{i}",
        ["frontend", *upstream, "--host", args.host,
         *forwarded(args, flags.FrontendFlags)],
        f"{front}:{args.grpc_port}", f"{scheme}://{front}:{args.http_port}/health",
        env=dict(front_env), security=security, instance_id=args.instance_id,
        # the --api-server-count frontends share them: checked once
        ports=[] if i else [(args.host, args.http_port, "--http-port"),
                            (args.host, args.grpc_port, "--grpc-port")])
        for i in range(count)]
    return [*(c for r in replicas for c in r.children), *frontends]


def _replica(args: argparse.Namespace, i: int, size: int, host: str,
             security: LinkSecurity) -> Replica:
    """Replica i's workers and scheduler; with one replica, exactly the single stack."""
    offset = i * args.data_parallel_port_stride if size > 1 else 0
    args = copy.copy(args)  # this replica's rendezvous and KV events
    if args.tensor_parallel_size > 1:  # the ranks rendezvous on this machine
        args.master_addr = args.master_addr or host
        if args.master_port is not None:
            args.master_port += offset
        elif size > 1 or not os.environ.get("MASTER_PORT"):
            args.master_port = _free_port(args.master_addr)
    args.kv_events_config, kv_endpoint, replay = _kv_events(args, i, size, offset, host)
    tag = "" if size == 1 else f"{i}-"
    workers = []
    for rank in range(args.tensor_parallel_size):
        port_ = args.worker_port + offset + rank
        metrics = args.worker_metrics_port + offset + rank if args.worker_metrics_port else 0
        workers.append(Child(
            f"worker-{tag}{rank}",
            ["worker", "--rank", str(rank), "--port", str(port_), "--metrics-port", str(metrics),
             "--host", args.inner_host, *forwarded(args, flags.WorkerFlags)],
            f"{host}:{port_}", env=secrets_env(args, flags.WorkerFlags),
            security=security, instance_id=args.instance_id,
            ports=[(args.inner_host, port_, "--worker-port"),
                   (args.inner_host, metrics, "--worker-metrics-port")]))
    sched_port = args.scheduler_port + offset
    metrics_port = args.scheduler_metrics_port + offset if args.scheduler_metrics_port else 0
    scheduler = Child(
        "scheduler" if size == 1 else f"scheduler-{i}",
        ["scheduler", "--port", str(sched_port), "--metrics-port", str(metrics_port),
         "--worker-addresses", ",".join(w.health_address for w in workers),
         "--host", args.inner_host,
         *forwarded(args, flags.SchedulerFlags)],
        f"{host}:{sched_port}", env={**secrets_env(args, flags.SchedulerFlags),
                                     **_nice_env(args)},
        security=security, instance_id=args.instance_id,
        ports=[(args.inner_host, sched_port, "--scheduler-port"),
               (args.inner_host, metrics_port, "--scheduler-metrics-port")])
    return Replica([*workers, scheduler], scheduler.health_address, kv_endpoint, replay)


def _kv_events(args: argparse.Namespace, i: int, size: int, offset: int,
               host: str) -> tuple[str | None, str | None, str | None]:
    """Replica i's --kv-events-config, and its publisher and replay endpoints as the
    frontend dials them. One replica: the flag as given. Several: a given config's
    tcp ports move by the replica's offset; without one, kv-aware routing gets
    private ipc:// sockets (a directory only this user can enter, removed at exit)."""
    given = args.kv_events_config
    if size == 1:
        return given, None, None
    if given:
        cfg = json.loads(given)
        cfg["endpoint"] = _shift(cfg.get("endpoint", "tcp://*:5557"), offset)
        if cfg.get("replay_endpoint"):
            cfg["replay_endpoint"] = _shift(cfg["replay_endpoint"], offset)
        dial = lambda e: e.replace("*", host).replace("0.0.0.0", host)  # noqa: E731
        return (json.dumps(cfg), dial(cfg["endpoint"]),
                dial(cfg["replay_endpoint"]) if cfg.get("replay_endpoint") else None)
    if args.data_parallel_routing != "kv-aware":
        return None, None, None
    directory = _kv_events_dir()
    endpoint, replay = f"ipc://{directory}/kv-{i}", f"ipc://{directory}/kv-replay-{i}"
    cfg = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
    return json.dumps(cfg), endpoint, replay


def _shift(endpoint: str, offset: int) -> str:
    """tcp://host:5557 -> tcp://host:(5557 + offset); other transports unchanged."""
    head, sep, tail = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not tail.isdigit():
        return endpoint
    return f"{head}{sep}{int(tail) + offset}"


_KV_DIR: list[str] = []


def _kv_events_dir() -> str:
    if not _KV_DIR:
        path = tempfile.mkdtemp(prefix="gapserve-kv-")  # mode 0700
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _KV_DIR.append(path)
    return _KV_DIR[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = serve_parser()
    args = flags.parse_args(parser, argv)
    flags.model_from_args(parser, args)
    try:  # said once here, before anything starts, not by each child as it exits
        problem = inner_bind_problem(args.inner_host, LinkSecurity.from_args(args),
                                     args.allow_insecure_inner)
    except (OSError, ValueError) as e:  # an unreadable --tls-* file, a lone --tls-cert
        parser.error(str(e))
    if problem is not None:
        parser.error(f"--inner-host: {problem}")
    if args.data_parallel_size > 1 and args.data_parallel_port_stride <= args.tensor_parallel_size:
        parser.error(f"--data-parallel-port-stride {args.data_parallel_port_stride} must exceed "
                     f"--tensor-parallel-size {args.tensor_parallel_size}: a replica's "
                     f"scheduler would take the port of the previous one's last rank")
    if flags.tool_flags_problem(args):
        parser.error(flags.tool_flags_problem(args))
    from shared.model_files.default_model import resolve_model

    try:  # converted once here, not raced by two children
        args.model = str(resolve_model(args.model))
    except (FileNotFoundError, OSError, RuntimeError) as e:
        parser.error(str(e))
    # this start's id: the health probes below accept only children that report it
    args.instance_id = args.instance_id or new_instance_id()
    try:
        supervisor = Supervisor(children(args))
        if (backoff := flags.restart_backoff_s()) is not None:
            supervisor.backoff_s = backoff
    except (OSError, ValueError) as e:  # an unreadable --tls-* file, a lone --tls-cert
        parser.error(str(e))
    try:  # every port, in serve's own flags, before anything starts or is announced
        for host, port, flag in (p for c in supervisor.children for p in c.ports):
            check_free(host, port, flag)
    except PortUnavailable as e:
        print(f"gapserve serve: {e}", file=sys.stderr, flush=True)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: supervisor.stop.set())
    supervisor.start()
    failed = None  # the child whose last error is serve's last line
    at_startup = False  # failed while starting: which child is found after stop_all
    try:
        problem = supervisor.wait_healthy(args.startup_timeout)
        if problem == "interrupted":
            return 0
        if problem is not None:
            supervisor.say(f"gapserve serve: {problem}; stopping")
            at_startup = True
            return 1
        host = _loopback(args.host)
        scheme = "https" if args.ssl_certfile else "http"
        replicas = f" on {args.data_parallel_size} replicas ({args.data_parallel_routing} " \
            f"routing)" if args.data_parallel_size > 1 else ""
        supervisor.say(
            f"gapserve: serving {args.served_model_name or os.path.basename(args.model)}"
            f"{replicas} (instance {args.instance_id})\n"
            f"  OpenAI API  {scheme}://{host}:{args.http_port}/v1\n"
            f"  gRPC        {host}:{args.grpc_port}  (gapserve.v1.Generation)\n"
            f"  Ctrl-C stops all services", sys.stdout)
        failed = supervisor.supervise()
        return 0 if failed is None else 1
    finally:
        supervisor.stop_all()
        if at_startup:  # the upstream refusal, not its consequences downstream
            failed = supervisor.cause()
        if failed is not None:
            supervisor.say(failed.exit_line())


if __name__ == "__main__":
    sys.exit(main())
