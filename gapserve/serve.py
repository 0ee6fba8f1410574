"""`gapserve serve`: worker(s), scheduler and frontend as processes on one machine.

Starts them together (the frontend loads its tokenizer while the worker loads the
model), waits until every one answers grpc.health.v1 SERVING, prints where to
connect, and stops all of them on Ctrl-C/SIGTERM, or as soon as one of them dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared import config as flags
from shared.grpc_server import check_health

STOP_TIMEOUT_S = 15.0  # per process, after SIGTERM, before SIGKILL


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gapserve serve",
        description="Run worker, scheduler and frontend as three processes on this machine.")
    flags.add_common_flags(p)
    flags.add_model_flag(p)
    flags.add_limit_flags(p)
    flags.add_worker_flags(p, with_ports=False)
    flags.add_scheduler_flags(p, with_ports=False)
    flags.add_frontend_flags(p, with_model=False, with_scheduler_address=False)
    g = p.add_argument_group("ports of the inner services (0 turns a metrics port off)")
    g.add_argument("--scheduler-port", type=flags.port, default=50052)
    g.add_argument("--worker-port", type=flags.port, default=50053, help="rank 0; rank r adds r")
    g.add_argument("--scheduler-metrics-port", type=flags.port, default=8001)
    g.add_argument("--worker-metrics-port", type=flags.port, default=8002,
                   help="rank 0; rank r adds r")
    g.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for all services to become healthy")
    return p


def _argv(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """Flags for a child process from the parsed namespace (None = leave unset)."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, ",".join(map(str, value))]
        else:
            out += [flag, str(value)]
    return out


COMMON = ("host", "otlp_traces_endpoint", "log_format", "log_level")
LIMITS = ("max_model_len", "max_num_batched_tokens", "max_num_seqs")
WORKER = ("model", "tensor_parallel_size", "device", "dtype", "kv_cache_memory",
          "gpu_memory_utilization", "num_gpu_blocks_override", "block_size", "seed",
          "load_format", "zero_cost_steps")
SCHEDULER = ("long_prefill_token_threshold", "scheduling_policy", "enable_prefix_caching",
             "async_scheduling", "enable_chunked_prefill")
FRONTEND = ("http_port", "grpc_port", "model", "served_model_name", "api_server_count")


def _loopback(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]  # after `python -m gapserve`
    health_address: str
    http_health_url: str | None = None
    process: subprocess.Popen | None = None

    def healthy(self) -> bool:
        if not check_health(self.health_address, timeout_s=1.0):
            return False
        if self.http_health_url is None:
            return True
        try:
            with urllib.request.urlopen(self.http_health_url, timeout=1.0) as reply:
                return reply.status == 200
        except OSError:
            return False


def children(args: argparse.Namespace) -> list[Child]:
    host = _loopback(args.host)
    workers = []
    for rank in range(args.tensor_parallel_size):
        port = args.worker_port + rank
        metrics = args.worker_metrics_port + rank if args.worker_metrics_port else 0
        workers.append(Child(
            f"worker-{rank}",
            ["worker", "--rank", str(rank), "--port", str(port), "--metrics-port", str(metrics),
             *_argv(args, COMMON + WORKER + LIMITS)],
            f"{host}:{port}"))
    addresses = ",".join(w.health_address for w in workers)
    scheduler = Child(
        "scheduler",
        ["scheduler", "--port", str(args.scheduler_port),
         "--metrics-port", str(args.scheduler_metrics_port), "--worker-addresses", addresses,
         *_argv(args, COMMON + SCHEDULER + LIMITS)],
        f"{host}:{args.scheduler_port}")
    # --api-server-count N: N frontends on the same ports; the kernel spreads connections
    count = getattr(args, "api_server_count", 1)
    frontends = [Child(
        "frontend" if count == 1 else f"frontend-{i}",
        ["frontend", "--scheduler-address", scheduler.health_address,
         *_argv(args, COMMON + FRONTEND)],
        f"{host}:{args.grpc_port}", f"http://{host}:{args.http_port}/health")
        for i in range(count)]
    return [*workers, scheduler, *frontends]


@dataclass(slots=True)
class Supervisor:
    children: list[Child]
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self, log_dir: Path | None = None, env: dict[str, str] | None = None) -> None:
        """Start every child; with log_dir, each writes its output to <name>.log there."""
        for child in self.children:
            out = None if log_dir is None else open(log_dir / f"{child.name}.log", "wb")
            try:
                child.process = subprocess.Popen(
                    [sys.executable, "-m", "gapserve", *child.argv], env=env,
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
    from shared.default_model import resolve_model

    try:  # converted once here, not raced by two children
        args.model = str(resolve_model(args.model))
    except (FileNotFoundError, OSError, RuntimeError) as e:
        parser.error(str(e))
    supervisor = Supervisor(children(args))
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
        print(f"gapserve: serving {args.served_model_name or os.path.basename(args.model)}\n"
              f"  OpenAI API  http://{host}:{args.http_port}/v1\n"
              f"  gRPC        {host}:{args.grpc_port}  (gapserve.v1.Generation)\n"
              f"  Ctrl-C stops all services", flush=True)
        while not supervisor.stop.wait(0.5):
            if (child := supervisor.dead()) is not None:
                print(f"gapserve serve: {child.name} exited with code "
                      f"{child.process.returncode}; stopping the others", file=sys.stderr)
                return 1
        return 0
    finally:
        supervisor.stop_all()


if __name__ == "__main__":
    sys.exit(main())
