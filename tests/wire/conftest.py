"""Worker and scheduler servicers in this process, over real loopback gRPC, on the
tiny random-weight model: fast enough for unit tests of the wire."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import Engine
from scheduler_svc.metrics import SchedulerTelemetry
from scheduler_svc.server import EngineServicer, WorkerGroup, engine_status
from shared.grpc_server import ServiceServer
from shared.proto import engine_pb2_grpc, worker_pb2_grpc
from shared.speculative_config import parse_speculative_config
from tests.integration.tiny_model import tiny_llama_dir
from worker_svc.config import WorkerConfig
from worker_svc.server import WorkerServicer


@pytest.fixture(scope="session")
def tiny_model_dir():
    return tiny_llama_dir()


@pytest.fixture(scope="session")
def tiny_runner(tiny_model_dir):
    from worker_svc.runner import ModelRunner
    return ModelRunner(WorkerConfig(model=tiny_model_dir, kv_cache_memory=4 << 20,
                                    max_model_len=256, max_num_seqs=16))


@dataclass(slots=True)
class WireStack:
    worker: ServiceServer
    scheduler: ServiceServer
    engine: Engine
    scheduler_core: Scheduler
    group: WorkerGroup
    channel: grpc.Channel

    @property
    def engine_stub(self) -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.scheduler.stop(0)
        self.engine.stop()
        self.group.close()
        self.worker.stop(0)


def start_worker(runner, max_workers: int = 4, port: int = 0) -> tuple[ServiceServer, int]:
    """A worker servicer over `runner` on a loopback port (0: a free one): (server, port)."""
    worker = ServiceServer(max_workers=max_workers)
    servicer = WorkerServicer(rank=0, tensor_parallel_size=1)
    worker.add(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "gapserve.v1.Worker")
    port = worker.start("127.0.0.1", port)
    servicer.runner = runner
    worker.set_serving()
    return worker, port


def start_wire_stack(runner, **scheduler_flags) -> WireStack:
    scheduler_flags.setdefault("async_scheduling", False)  # one step in flight unless asked
    worker, worker_port = start_worker(runner)
    group = WorkerGroup([f"127.0.0.1:{worker_port}"])
    info = group.handshake(timeout_s=10)
    spec = parse_speculative_config(info.speculative_config)  # adopted, as the server does
    cfg = SchedulerConfig(block_size=info.block_size, max_model_len=info.max_model_len,
                          max_num_seqs=16, max_num_batched_tokens=256,
                          speculative_config=spec, **scheduler_flags)
    core = Scheduler(cfg, info.num_kv_blocks)
    telemetry = SchedulerTelemetry(info.model_name, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   spec.num_speculative_tokens if spec else 0)
    engine = Engine(core, group, info, cfg.max_model_len, telemetry=telemetry)
    group.open_streams()
    engine.start()
    scheduler = ServiceServer(max_workers=8)
    engine_servicer = EngineServicer()
    scheduler.add(engine_pb2_grpc.add_EngineServicer_to_server, engine_servicer,
                  "gapserve.v1.Engine")
    port = scheduler.start("127.0.0.1", 0)
    engine_servicer.ready(engine, lambda: engine_status(engine, core, telemetry))
    scheduler.set_serving()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return WireStack(worker, scheduler, engine, core, group, channel)


@pytest.fixture
def wire_stack(tiny_runner):
    stack = start_wire_stack(tiny_runner)
    yield stack
    stack.close()
