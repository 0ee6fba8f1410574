"""Runs the stack that docker-compose.yml describes as local processes: the same
entry point and commands, the same environment (container ports moved to free
loopback ports), started in depends_on order, each dependency waited for with its
own compose health check. What a container engine would add (images, networks) is
the only thing left out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import (trace_service_pb2,
                                                    trace_service_pb2_grpc)

from .compose_file import (ROOT, depends_on, dockerfile_entrypoint, duration_s,
                           gapserve_services, healthcheck_argv, start_order, LoopbackPorts)

VENV_BIN = Path(sys.executable).parent
OTLP_GRPC_PORT = 4317


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Stands in for the tracing backend: accepts OTLP/gRPC trace exports and keeps
    the names of the services that sent spans."""

    def __init__(self, port: int) -> None:
        self.services: set[str] = set()
        self.spans = 0
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 (the gRPC method name)
        with self.lock:
            for rs in request.resource_spans:
                for attr in rs.resource.attributes:
                    if attr.key == "service.name":
                        self.services.add(attr.value.string_value)
                self.spans += sum(len(ss.spans) for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def close(self) -> None:
        self.server.stop(grace=None)


@dataclass(slots=True)
class Service:
    name: str
    process: subprocess.Popen
    env: dict[str, str]
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


@dataclass(slots=True)
class LocalStack:
    doc: dict
    log_dir: Path
    ports: LoopbackPorts = field(init=False)
    services: dict[str, Service] = field(default_factory=dict)
    receivers: dict[str, OtlpReceiver] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ports = LoopbackPorts(set(self.doc["services"]))

    def start(self) -> None:
        gapserve = gapserve_services(self.doc)
        for name in start_order(self.doc):
            if name not in gapserve:
                self._start_stand_in(name)
                continue
            for dep, condition in depends_on(self.doc["services"][name]).items():
                if condition == "service_healthy":
                    self.wait_healthy(dep)
            self._start(name, gapserve[name])

    def _start_stand_in(self, name: str) -> None:
        # Jaeger becomes an OTLP receiver on its port; nothing here needs Prometheus
        # to run (the tests scrape its targets themselves). sglang-router is the
        # wheel's own binary, as its image runs it (deploy/sglang-router/Dockerfile).
        if name == "jaeger":
            self.receivers[name] = OtlpReceiver(self.ports.port(name, OTLP_GRPC_PORT))
        elif name == "sglang-router":
            self._start_router(name, self.doc["services"][name])

    def _start_router(self, name: str, svc: dict) -> None:
        """The router's command with its ports and worker URLs moved to loopback."""
        for dep, condition in depends_on(svc).items():
            if condition == "service_healthy":
                self.wait_healthy(dep)
        args, previous = [], None
        for arg in svc["command"]:
            if previous in ("--port", "--prometheus-port"):
                arg = str(self.ports.port(name, int(arg)))
            else:
                arg = self.ports.value(name, "", arg)
            args.append(arg)
            previous = arg if arg.startswith("--") else None
        env = {**os.environ, **{k: str(v) for k, v in (svc.get("environment") or {}).items()}}
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", *args],
                                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.services[name] = Service(name, proc, env, log_path)

    def _start(self, name: str, svc: dict) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GAPSERVE_", "OTEL_"))}
        for keep in ("GAPSERVE_CACHE_DIR", "GAPSERVE_DEFAULT_MODEL_WHEEL"):
            if keep in os.environ:  # where this machine keeps the converted default model
                env[keep] = os.environ[keep]
        env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"  # the image's PATH
        env.update(self.ports.environment(name, svc))
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(dockerfile_entrypoint() + list(svc["command"]), cwd=ROOT,
                                    env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.services[name] = Service(name, proc, env, log_path)

    def healthy(self, name: str) -> bool:
        svc = self.services[name]
        hc = self.doc["services"][name]["healthcheck"]
        try:
            result = subprocess.run(healthcheck_argv(self.doc["services"][name]), cwd=ROOT,
                                    env=svc.env, capture_output=True,
                                    timeout=duration_s(hc.get("timeout"), 30.0))
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0

    def wait_healthy(self, name: str) -> None:
        """Compose's service_healthy: the health check passes before start_period
        plus retries * interval runs out; here also: the process must be alive."""
        hc = self.doc["services"][name]["healthcheck"]
        deadline = time.monotonic() + duration_s(hc.get("start_period"), 0.0) + \
            duration_s(hc.get("interval"), 30.0) * int(hc.get("retries", 3))
        # Compose probes every start_interval (interval here: 5 s); a test polls faster,
        # since what it waits for is the check passing, not compose's cadence.
        pause = min(duration_s(hc.get("start_interval"), 5.0), 0.25)
        svc = self.services[name]
        while not self.healthy(name):
            if svc.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {svc.process.returncode}:\n"
                                   f"{svc.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} never became healthy:\n{svc.log_tail()}")
            time.sleep(pause)  # spaces the probes while a service starts

    def stop(self) -> dict[str, int | None]:
        """SIGTERM in reverse start order (as compose does); returns exit codes."""
        codes = {}
        for name in reversed(list(self.services)):
            proc = self.services[name].process
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            codes[name] = proc.returncode
        for receiver in self.receivers.values():
            receiver.close()
        return codes


@contextmanager
def running_stack(doc: dict, log_dir: Path) -> Iterator[LocalStack]:
    """The stack of `doc` with the real default model, up until its frontend is healthy."""
    from shared.model_files.default_model import ensure_default_model
    ensure_default_model()  # the image converts it at build time
    stack = LocalStack(doc, log_dir)
    try:
        stack.start()
        stack.wait_healthy("frontend")
        yield stack
    finally:
        stack.stop()
