"""The REAL stack for integration tests: worker, scheduler and frontend as separate
processes on free loopback ports (started exactly as `gapserve serve` starts them),
waited for with grpc.health.v1, stopped with SIGTERM at the end.

Fixtures:
    tiny_stack      session-wide, the tiny random-weight Llama (fast)
    default_stack   session-wide, the real default model (tests marked e2e)
    backend_stack   session-wide, worker + scheduler only, tiny model
    start_stack_factory   a factory for a stack with its own flags, stopped after the test

    stack.openai()            an openai.OpenAI client for its HTTP API
    stack.generation_stub()   a gapserve.v1.Generation stub (frontend gRPC)
    stack.engine_stub()       a gapserve.v1.Engine stub (the scheduler)
    stack.engine_status()     the scheduler's live EngineStatus
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from gapserve.serve import children, serve_parser
from gapserve.supervisor import Supervisor
from shared import config
from shared.proto import engine_pb2, engine_pb2_grpc, generate_pb2_grpc
from tests.integration.tiny_model import tiny_llama_dir
from tests.ports import free_ports

ALL_SERVICES = ("worker", "scheduler", "frontend")
STARTUP_TIMEOUT_S = 300.0
# tiny model: a small pool and context keep start-up and memory small
TINY_FLAGS = ["--max-model-len", "512", "--kv-cache-memory", str(8 << 20),
              "--max-num-seqs", "64", "--max-num-batched-tokens", "512"]


@dataclass(slots=True)
class Stack:
    model_dir: Path
    log_dir: Path
    http_port: int
    grpc_port: int
    scheduler_port: int
    worker_port: int
    supervisor: Supervisor
    _channels: list = field(default_factory=list)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    @property
    def worker_address(self) -> str:
        return f"127.0.0.1:{self.worker_port}"

    @property
    def served_model_name(self) -> str:
        return self.model_dir.name

    def process(self, name: str):
        return next(c.process for c in self.supervisor.children if c.name.startswith(name))

    def openai(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=self.http_url + "/v1", api_key="unused",
                             max_retries=0, **kwargs)

    def channel(self, address: str) -> grpc.Channel:
        channel = grpc.insecure_channel(address)
        self._channels.append(channel)
        return channel

    def generation_stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self.channel(self.grpc_address))

    def engine_stub(self) -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(self.channel(self.scheduler_address))

    def engine_status(self) -> engine_pb2.EngineStatus:
        return self.engine_stub().GetStatus(engine_pb2.GetStatusRequest(), timeout=10)

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
                         for p in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        for channel in self._channels:
            channel.close()
        self.supervisor.stop_all()


def start_stack(model_dir: Path, log_dir: Path, *, services=ALL_SERVICES,
                flags: list[str] = (), env: dict[str, str] | None = None,
                spare_workers: list[str] = ()) -> Stack:
    """Start the named services with `gapserve serve`'s flags (and env added to
    their environment); raise (with the services' logs) if they are not all
    healthy in time. spare_workers: worker groups ("host:port,...") the scheduler
    may fail over to, appended to its --worker-addresses after ';'."""
    http, grpc_port, sched, worker = free_ports(4)
    argv = ["--model", str(model_dir), "--http-port", str(http), "--grpc-port", str(grpc_port),
            "--scheduler-port", str(sched), "--worker-port", str(worker),
            "--scheduler-metrics-port", "0", "--worker-metrics-port", "0",
            "--log-format", "json", *flags]
    args = config.parse_args(serve_parser(), argv, environ={})
    chosen = [c for c in children(args) if c.name.split("-")[0] in services]
    for child in chosen:
        if child.name == "scheduler" and spare_workers:  # `gapserve serve` starts no spares
            i = child.argv.index("--worker-addresses") + 1
            child.argv[i] = ";".join([child.argv[i], *spare_workers])
    supervisor = Supervisor(chosen)
    log_dir.mkdir(parents=True, exist_ok=True)
    extra_env = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("GAPSERVE_")}
    env.update(OMP_NUM_THREADS="1", GAPSERVE_CACHE_DIR=os.environ.get(
        "GAPSERVE_CACHE_DIR", str(Path.home() / ".cache" / "gapserve")))
    env.update(extra_env)
    supervisor.start(log_dir, env)
    stack = Stack(model_dir, log_dir, http, grpc_port, sched, worker, supervisor)
    problem = supervisor.wait_healthy(STARTUP_TIMEOUT_S)
    if problem is not None:
        stack.stop()
        raise RuntimeError(f"the stack did not start: {problem}\n{stack.logs()}")
    return stack


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_llama_dir()


@pytest.fixture(scope="session")
def tiny_stack(tiny_model_dir, tmp_path_factory):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("tiny-stack"), flags=TINY_FLAGS)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def backend_stack(tiny_model_dir, tmp_path_factory):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("backend-stack"),
                        services=("worker", "scheduler"), flags=TINY_FLAGS)
    yield stack
    stack.stop()


# The default model is a Q4_1 GGUF, served on the quantized path unless --dtype names a
# float type: the stacks whose output is compared with transformers' gguf_file= load
# take the exact (dequantized) path, which is token-equal to it (docs/formats.md).
EXACT = ["--dtype", "float32"]


@pytest.fixture(scope="session")
def default_stack(tmp_path_factory):
    from shared.model_files.default_model import ensure_default_model
    stack = start_stack(ensure_default_model(), tmp_path_factory.mktemp("default-stack"),
                        flags=["--max-model-len", "2048", "--kv-cache-memory", str(256 << 20),
                               *EXACT])
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def agent_stack(tmp_path_factory):
    """The default model with auto tool choice (hermes), as agent frameworks need it."""
    from shared.model_files.default_model import ensure_default_model
    stack = start_stack(ensure_default_model(), tmp_path_factory.mktemp("agent-stack"),
                        flags=["--max-model-len", "2048", "--kv-cache-memory", str(256 << 20),
                               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                               *EXACT])
    yield stack
    stack.stop()


@pytest.fixture
def start_stack_factory(tmp_path):
    """start_stack_factory(model_dir, services=..., flags=[...]) -> Stack, stopped afterwards."""
    started: list[Stack] = []

    def start(model_dir: Path, **kwargs) -> Stack:
        stack = start_stack(model_dir, tmp_path / f"stack-{len(started)}", **kwargs)
        started.append(stack)
        return stack

    yield start
    for stack in started:
        stack.stop()
