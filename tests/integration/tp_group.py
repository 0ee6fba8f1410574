"""Drive the ranks of one tensor-parallel worker over their gRPC Step streams, the way
the scheduler fans out: every rank gets every step, rank 0 answers with the tokens.
Quacks like a ModelRunner for tests/worker/step_driver.StepDriver."""

from __future__ import annotations

import queue

import grpc

from shared.wire.common import model_info_from_proto
from shared.wire.worker import runner_output_from_proto, scheduler_output_to_proto
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.types import ModelInfo, ModelRunnerOutput, SchedulerOutput


class RankGroupClient:
    def __init__(self, addresses: list[str], timeout_s: float = 120.0) -> None:
        self.channels = [grpc.insecure_channel(a) for a in addresses]
        stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.infos = [stub.Handshake(worker_pb2.HandshakeRequest(
            tensor_parallel_size=len(addresses)), timeout=timeout_s, wait_for_ready=True)
            for stub in stubs]
        info = self.infos[0].model_info
        self.block_size, self.num_kv_blocks = info.block_size, info.num_kv_blocks
        self.eos_token_ids = list(info.eos_token_ids)
        self.outboxes = [queue.SimpleQueue() for _ in stubs]
        self.replies = [stub.Step(iter(box.get, None)) for stub, box in
                        zip(stubs, self.outboxes)]

    def model_info(self) -> ModelInfo:
        """Rank 0's, as the scheduler reads it at the handshake."""
        return model_info_from_proto(self.infos[0].model_info)

    def submit(self, step: SchedulerOutput) -> None:
        msg = scheduler_output_to_proto(step)
        for box in self.outboxes:
            box.put(msg)

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(step)
        answers = [next(r) for r in self.replies]
        assert len({a.step_id for a in answers}) == 1, [a.step_id for a in answers]
        return runner_output_from_proto(answers[0])

    def close(self) -> None:
        for box in self.outboxes:
            box.put(None)
        for r in self.replies:
            r.cancel()
        for c in self.channels:
            c.close()
