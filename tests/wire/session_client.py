"""A blocking client of the scheduler's Session stream, for tests."""

from __future__ import annotations

import queue
import time

from shared.wire.common import sampling_to_proto
from shared.proto import engine_pb2
from shared.types import SamplingParams


class SessionClient:
    def __init__(self, stub) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Session(iter(self._outbox.get, None))
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, engine_pb2.RequestOutput] = {}
        self.rejected: dict[str, engine_pb2.Rejection] = {}

    def add(self, req_id: str, prompt: list[int], **sampling) -> None:
        self._outbox.put(add_message(req_id, prompt, **sampling))

    def send_batch(self, *requests: engine_pb2.EngineRequest) -> None:
        """Several adds/aborts in one message, as a frontend sends what queued up."""
        self._outbox.put(engine_pb2.EngineRequest(
            batch=engine_pb2.EngineRequests(requests=list(requests))))

    def add_raw(self, add: engine_pb2.AddRequest) -> None:
        self._outbox.put(engine_pb2.EngineRequest(add=add))

    def abort(self, *req_ids: str) -> None:
        self._outbox.put(abort_message(*req_ids))

    def read(self) -> engine_pb2.EngineResponse:
        reply = next(self.call)
        for out in reply.outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                self.finished[out.request_id] = out
        for rej in reply.rejections:
            self.rejected[rej.request_id] = rej
        return reply

    def wait_ended(self, *req_ids: str) -> None:
        while not all(r in self.finished or r in self.rejected for r in req_ids):
            self.read()

    def close(self) -> None:
        self._outbox.put(None)
        self.call.cancel()


def add_message(req_id: str, prompt: list[int], **sampling) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(add=engine_pb2.AddRequest(
        request_id=req_id, prompt_token_ids=prompt,
        sampling_params=sampling_to_proto(SamplingParams(**sampling))))


def abort_message(*req_ids: str) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(abort=engine_pb2.AbortRequests(request_ids=list(req_ids)))


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll a condition another process or thread makes true, up to a deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
