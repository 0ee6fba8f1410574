"""Issue 28 item 10: a reconnect counts once per Step session a worker actually
accepted. A worker still held by another scheduler's stream (a dead one the worker
has not noticed yet, as after a scheduler restart) answers the handshake but
refuses the stream; that is a failed reconnect round (logged, backed off), not a
reconnect, so one scheduler restart no longer shows as a burst of them."""

from __future__ import annotations

import time

from structlog.testing import capture_logs

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import CLOSED, Engine
from scheduler_svc.engine_errors import WorkerLost
from scheduler_svc.worker_group import WorkerGroup
from shared.types import SamplingParams
from tests.wire.conftest import start_worker

HELD = "another scheduler already drives this worker"


def refused(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "worker_reconnect_failed" and HELD in e["error"]]


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_refused_step_stream_is_a_failed_round_and_the_accepted_one_counts_once(tiny_runner):
    worker, port = start_worker(tiny_runner)
    address = f"127.0.0.1:{port}"
    old = WorkerGroup([address])  # the scheduler that died: the worker still holds its stream
    old.handshake(timeout_s=10)
    old.open_streams()
    assert old._await_accepted(10) is None
    group = WorkerGroup([address])
    info = group.handshake(timeout_s=10)  # the worker answers the new scheduler's handshake
    cfg = SchedulerConfig(block_size=info.block_size, max_model_len=info.max_model_len,
                          max_num_seqs=16, max_num_batched_tokens=256)
    engine = Engine(Scheduler(cfg, info.num_kv_blocks), group, info, cfg.max_model_len)
    try:
        with capture_logs() as logs:
            group.open_streams(on_lost=engine.post_worker_lost)  # refused: the old one holds it
            engine.start()
            wait_for(lambda: engine.num_reconnect_failures >= 2, "refused reconnect rounds")
            assert len(refused(logs)) == 1  # a burst of failed rounds is logged once
            assert engine.num_worker_reconnects == 0
            old.close()  # the worker lets go of the dead scheduler's stream
            wait_for(lambda: engine.num_worker_reconnects >= 1, "the reconnect")
        session = engine.open_session()
        engine.add(session, Request("after", [1, 2, 3], SamplingParams(max_tokens=4)))
        while (items := session.outbox.get(timeout=30)) is not CLOSED and \
                not any(getattr(i, "finished", False) for i in items):
            pass
        assert engine.num_worker_reconnects == 1  # one session re-established, one count
        assert len([e for e in logs if e["event"] == "worker_reconnected"]) == 1
    finally:
        engine.stop()
        group.close()
        old.close()
        worker.stop(0)


def test_the_same_scheduler_reconnecting_is_handed_the_worker_before_its_old_stream_ends(
        tiny_runner):
    """A reconnect ends the scheduler's stream and opens a new one at once; on a loaded
    machine the old stream's end reached the worker after its handover wait and the
    scheduler failed over to a spare. The worker knows the scheduler by its id on the
    stream: it ends the old stream itself and takes the new one, while a different
    scheduler is still refused."""
    worker, port = start_worker(tiny_runner)
    address = f"127.0.0.1:{port}"
    group, other = WorkerGroup([address]), WorkerGroup([address])
    try:
        group.handshake(timeout_s=10)
        group.open_streams()
        assert group._await_accepted(10) is None
        old_answers = group._answers[0]
        group.open_streams()  # the old stream left open: its end has not reached the worker
        assert group._await_accepted(10) is None
        assert isinstance(old_answers.get(timeout=30), WorkerLost)  # the worker ended it
        other.handshake(timeout_s=10)
        other.open_streams()
        assert HELD in other._await_accepted(10)
    finally:
        other.close()
        group.close()
        worker.stop(0)
