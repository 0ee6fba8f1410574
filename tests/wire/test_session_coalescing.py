"""What each end of the frontend <-> scheduler Session stream puts in one message
when items queued up behind a slow reader or writer, without a network: the
scheduler's steps that a frontend has not read yet, and the frontend's adds and
aborts that queued while its last message was being written."""

from __future__ import annotations

import asyncio
import queue

from frontend_svc.engine.engine_client import _drain
from scheduler_svc.engine import CLOSED
from scheduler_svc.engine_errors import ErrorCode, Failure
from scheduler_svc.server import coalesce
from shared.grpc_server import COALESCE_BYTES
from shared.proto import common_pb2, engine_pb2
from shared.types import FinishReason, RequestOutput
from tests.wire.session_client import abort_message, add_message


class Count:
    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n


def step(*pairs: tuple[str, int]) -> list:
    return [RequestOutput(req_id, [token]) for req_id, token in pairs]


def test_steps_queued_behind_a_slow_frontend_go_in_one_message_in_step_order():
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox.put(step(("a", 2), ("b", 20)))
    outbox.put(step(("a", 3)) + [Failure("b", ErrorCode.UNAVAILABLE, "worker lost")])
    outbox.put([RequestOutput("a", [4], finish_reason=FinishReason.LENGTH)])
    reply, steps, closed = coalesce(step(("a", 1), ("b", 10)), outbox)
    assert (steps, closed) == (4, False) and outbox.empty()
    assert [(o.request_id, list(o.new_token_ids)) for o in reply.outputs] == [
        ("a", [1]), ("b", [10]), ("a", [2]), ("b", [20]), ("a", [3]), ("a", [4])]
    assert reply.outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert [(r.request_id, r.status.message) for r in reply.rejections] == [("b", "worker lost")]


def test_a_step_with_nothing_behind_it_goes_alone():
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    reply, steps, closed = coalesce(step(("a", 1)), outbox)
    assert (steps, closed, len(reply.outputs)) == (1, False, 1)


def test_a_message_stops_growing_at_the_byte_budget_and_the_rest_waits():
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    big = [RequestOutput("r", list(range(1000)))]  # ~2 KB a step
    for _ in range(400):
        outbox.put(big)
    reply, steps, _ = coalesce(big, outbox)
    per_step = reply.outputs[0].ByteSize()
    assert COALESCE_BYTES <= reply.ByteSize() < COALESCE_BYTES + 4 * per_step
    assert steps == len(reply.outputs) < 401
    left = 0
    while not outbox.empty():
        outbox.get_nowait()
        left += 1
    assert steps + left == 401  # nothing dropped


def test_the_session_end_behind_queued_steps_is_reported_after_them():
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox.put(step(("a", 2)))
    outbox.put(CLOSED)
    outbox.put(step(("a", 3)))  # never read: the session ended before it
    reply, steps, closed = coalesce(step(("a", 1)), outbox)
    assert (steps, closed) == (2, True)
    assert [list(o.new_token_ids) for o in reply.outputs] == [[1], [2]]


def drained(items: list) -> tuple[list[engine_pb2.EngineRequest], int]:
    """What _drain sends for items that were all queued before it ran."""
    async def body():
        outbox: asyncio.Queue = asyncio.Queue()
        for item in items:
            outbox.put_nowait(item)
        batched = Count()
        return [msg async for msg in _drain(outbox, batched)], batched.value
    return asyncio.run(body())


def test_the_frontend_sends_what_queued_up_as_one_batch_in_order():
    sent, batched = drained([add_message("a", [1, 2]), add_message("b", [3]),
                             abort_message("a"), None])
    assert len(sent) == 1 and sent[0].WhichOneof("kind") == "batch" and batched == 2
    items = sent[0].batch.requests
    assert [m.WhichOneof("kind") for m in items] == ["add", "add", "abort"]
    assert [items[0].add.request_id, items[1].add.request_id] == ["a", "b"]
    assert list(items[2].abort.request_ids) == ["a"]


def test_a_lone_request_goes_as_itself_and_the_end_stops_the_stream():
    sent, batched = drained([add_message("a", [1]), None, add_message("never", [2])])
    assert [m.WhichOneof("kind") for m in sent] == ["add"] and batched == 0


def test_a_frontend_batch_stops_at_the_byte_budget():
    prompt = list(range(20_000, 22_000))  # ~6 KB an add
    items = [add_message(f"r{i}", prompt) for i in range(100)] + [None]
    sent, batched = drained(items)
    assert len(sent) >= 2 and all(m.WhichOneof("kind") == "batch" for m in sent)
    assert sent[0].ByteSize() < COALESCE_BYTES + 2 * items[0].ByteSize()
    ids = [m.add.request_id for msg in sent for m in msg.batch.requests]
    assert ids == [f"r{i}" for i in range(100)] and batched == 100 - len(sent)
