"""`gapserve serve`: worker(s), scheduler and frontend as processes on one machine.

With --data-parallel-size N it runs N replicas, each its own scheduler and worker
ranks on its own ports (replica i: every inner port + i x --data-parallel-port-stride)
and, for kv-aware routing, its own KV event publisher; the frontend(s) hold a
session to every replica and route between them (frontend_svc/engine/replicas.py).

Starts them together (the frontend loads its tokenizer while the worker loads the
model), waits until every one answers grpc.health.v1 SERVING, prints where to
connect, restarts any that dies (the others carry on: docs/resilience.md), and
stops all of them on Ctrl-C/SIGTERM.
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
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared import config as flags
from shared.grpc_server import check_health
from shared.link_security import LinkSecurity, inner_bind_problem

STOP_TIMEOUT_S = 15.0  # per process, after SIGTERM, before SIGKILL
RESTART_BACKOFF_S = 0.5  # first wait before restarting a child that died; doubles


def serve_parser() -> argparse.ArgumentParser:
    return flags.serve_parser()


def _loopback(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]  # after `python -m gapserve`
    health_address: str
    http_health_url: str | None = None
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # secrets, GAPSERVE_* variables
    security: LinkSecurity = field(default_factory=LinkSecurity)

    def healthy(self) -> bool:
        if not check_health(self.health_address, timeout_s=1.0, security=self.security):
            return False
        if self.http_health_url is None:
            return True
        # our own child on loopback: its HTTPS certificate is not what is checked here
        context = ssl._create_unverified_context() \
            if self.http_health_url.startswith("https") else None
        try:
            with urllib.request.urlopen(self.http_health_url, timeout=1.0,
                                        context=context) as reply:
                return reply.status == 200
        except OSError:
            return False


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


def children(args: argparse.Namespace) -> list[Child]:
    host = _loopback(args.inner_host)
    security = LinkSecurity.from_args(args)
    size = getattr(args, "data_parallel_size", 1)
    replicas = [_replica(args, i, size, host, security) for i in range(size)]
    front = _loopback(args.host)
    scheme = "https" if args.ssl_certfile else "http"
    # --api-server-count N: N frontends on the same ports; the kernel spreads connections
    count = getattr(args, "api_server_count", 1)
    front_env = flags.secrets_env(args, flags.FrontendFlags)
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
         *flags.forwarded(args, flags.FrontendFlags)],
        f"{front}:{args.grpc_port}", f"{scheme}://{front}:{args.http_port}/health",
        env=dict(front_env), security=security)
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
             "--host", args.inner_host, *flags.forwarded(args, flags.WorkerFlags)],
            f"{host}:{port_}", env=flags.secrets_env(args, flags.WorkerFlags),
            security=security))
    sched_port = args.scheduler_port + offset
    metrics_port = args.scheduler_metrics_port + offset if args.scheduler_metrics_port else 0
    scheduler = Child(
        "scheduler" if size == 1 else f"scheduler-{i}",
        ["scheduler", "--port", str(sched_port), "--metrics-port", str(metrics_port),
         "--worker-addresses", ",".join(w.health_address for w in workers),
         "--host", args.inner_host,
         *flags.forwarded(args, flags.SchedulerFlags)],
        f"{host}:{sched_port}", env=flags.secrets_env(args, flags.SchedulerFlags),
        security=security)
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


@dataclass(slots=True)
class Supervisor:
    children: list[Child]
    stop: threading.Event = field(default_factory=threading.Event)
    log_dir: Path | None = None
    env: dict[str, str] | None = None
    restarts: int = 0

    def start(self, log_dir: Path | None = None, env: dict[str, str] | None = None) -> None:
        """Start every child; with log_dir, each writes its output to <name>.log there."""
        self.log_dir, self.env = log_dir, env
        for child in self.children:
            self.launch(child)

    def launch(self, child: Child, env: dict[str, str] | None = None) -> None:
        """(Re)start one child with the same flags (its log is appended to); env
        replaces the supervisor's environment for this launch only. The child's own
        env (its secrets) is laid over either."""
        out = None if self.log_dir is None else open(self.log_dir / f"{child.name}.log", "ab")
        base = env if env is not None else self.env if self.env is not None else os.environ
        try:
            child.process = subprocess.Popen(
                [sys.executable, "-m", "gapserve", *child.argv], env={**base, **child.env},
                stdout=out, stderr=subprocess.STDOUT if out else None)
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor

    def dead(self) -> Child | None:
        return next((c for c in self.children if c.process.poll() is not None), None)

    def wait_healthy(self, timeout_s: float) -> str | None:
        """None once all are healthy; otherwise why not."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.children)
        while pending:
            if self.stop.is_set():
                return "interrupted"
            if (child := self.dead()) is not None:
                return f"{child.name} exited with code {child.process.returncode}"
            if time.monotonic() > deadline:
                return f"{', '.join(c.name for c in pending)} not healthy after {timeout_s:.0f} s"
            pending = [c for c in pending if not c.healthy()]
            if pending:
                self.stop.wait(0.5)
        return None

    def stop_all(self) -> None:
        """SIGTERM in reverse start order (frontend first), SIGKILL after a timeout."""
        for child in reversed(self.children):
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            if child.process is None:
                continue
            try:
                child.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = serve_parser()
    args = flags.parse_args(parser, argv)
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
    from shared.default_model import resolve_model

    try:  # converted once here, not raced by two children
        args.model = str(resolve_model(args.model))
    except (FileNotFoundError, OSError, RuntimeError) as e:
        parser.error(str(e))
    try:
        supervisor = Supervisor(children(args))
    except (OSError, ValueError) as e:  # an unreadable --tls-* file, a lone --tls-cert
        parser.error(str(e))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: supervisor.stop.set())
    supervisor.start()
    try:
        problem = supervisor.wait_healthy(args.startup_timeout)
        if problem is not None:
            if problem != "interrupted":
                print(f"gapserve serve: {problem}; stopping", file=sys.stderr)
            return 0 if problem == "interrupted" else 1
        host = _loopback(args.host)
        scheme = "https" if args.ssl_certfile else "http"
        replicas = f" on {args.data_parallel_size} replicas ({args.data_parallel_routing} " \
            f"routing)" if args.data_parallel_size > 1 else ""
        print(f"gapserve: serving {args.served_model_name or os.path.basename(args.model)}"
              f"{replicas}\n"
              f"  OpenAI API  {scheme}://{host}:{args.http_port}/v1\n"
              f"  gRPC        {host}:{args.grpc_port}  (gapserve.v1.Generation)\n"
              f"  Ctrl-C stops all services", flush=True)
        backoff = RESTART_BACKOFF_S
        while not supervisor.stop.wait(backoff):
            if (child := supervisor.dead()) is None:
                backoff = RESTART_BACKOFF_S
                continue
            # The others carry on (docs/resilience.md): a restarted worker is reconnected
            # by the scheduler, a restarted scheduler by the frontend.
            print(f"gapserve serve: {child.name} exited with code {child.process.returncode}; "
                  f"restarting it", file=sys.stderr, flush=True)
            supervisor.launch(child)
            supervisor.restarts += 1
            backoff = min(backoff * 2, 10.0)  # a child that keeps dying is not spun on
        return 0
    finally:
        supervisor.stop_all()


if __name__ == "__main__":
    sys.exit(main())
