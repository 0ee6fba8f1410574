"""Workers that come back after a loss with a KV pool of another size (a worker's
default pool is sized from the memory free at its start, so a restart on a busier
host gets fewer blocks): the scheduler adopts the new size, since the loss emptied
its own pool, and resends what was in flight (docs/resilience.md). Workers that
cannot take over (a max_model_len below the scheduler's) are refused by name and
tried again, never half-adopted. Real worker servicers over loopback gRPC."""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from scheduler_svc.core.config import ConfigError, SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import CLOSED, Engine
from scheduler_svc.worker_group import WorkerGroup
from shared.types import SamplingParams
from tests.wire.conftest import start_worker
from worker_svc.config import WorkerConfig

PROMPT = [5, 17, 99, 3, 250, 41, 8]


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def runner(model_dir: str, kv_cache_memory: int, max_model_len: int = 256):
    from worker_svc.runner import ModelRunner
    return ModelRunner(WorkerConfig(model=model_dir, kv_cache_memory=kv_cache_memory,
                                    max_model_len=max_model_len, max_num_seqs=16))


def tokens(session, req_id: str, on_first=None) -> list[int]:
    """Every token of req_id until it ends; on_first() once its first tokens came."""
    out: list[int] = []
    while True:
        items = session.outbox.get(timeout=60)
        assert items is not CLOSED, "the session closed before the request ended"
        for item in items:
            assert getattr(item, "req_id", req_id) == req_id, item
            out += item.new_token_ids
            if item.finish_reason is not None:
                return out
        if on_first is not None and out:
            on_first()
            on_first = None


@pytest.fixture
def stack(tiny_runner):
    worker, port = start_worker(tiny_runner, max_workers=2)
    group = WorkerGroup([f"127.0.0.1:{port}"])
    info = group.handshake(timeout_s=10)
    cfg = SchedulerConfig(block_size=info.block_size, max_model_len=info.max_model_len,
                          max_num_seqs=16, max_num_batched_tokens=256)
    core = Scheduler(cfg, info.num_kv_blocks)
    engine = Engine(core, group, info, cfg.max_model_len)
    group.open_streams(on_lost=engine.post_worker_lost)
    engine.start()
    servers = [worker]
    yield engine, core, port, servers
    engine.stop()
    group.close()
    for server in servers:
        server.stop(0)


def test_workers_back_with_a_smaller_pool_take_over_and_the_request_ends_token_equal(
        stack, tiny_model_dir):
    engine, core, port, servers = stack
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    session = engine.open_session()
    engine.add(session, Request("ref", list(PROMPT), params))
    reference = tokens(session, "ref")
    before = engine.model_info.num_kv_blocks
    small = runner(tiny_model_dir, kv_cache_memory=1 << 20)  # half the blocks or fewer
    assert small.num_kv_blocks < before

    def lose_and_restart_smaller() -> None:
        servers[0].stop(0)  # the worker dies mid-request...
        servers.append(start_worker(small, max_workers=2, port=port)[0])  # ...and is back

    with capture_logs() as logs:
        engine.add(session, Request("lost", list(PROMPT), params))
        got = tokens(session, "lost", on_first=lose_and_restart_smaller)
    assert got == reference
    assert engine.num_requests_recovered == 1 and engine.num_worker_reconnects == 1
    assert core.num_total_blocks == core.stats().num_total_blocks == small.num_kv_blocks
    assert engine.model_info.num_kv_blocks == small.num_kv_blocks
    resized = [e for e in logs if e["event"] == "kv_pool_resized"]
    assert [(e["was"], e["num_kv_blocks"]) for e in resized] == [(before, small.num_kv_blocks)]
    wait_for(lambda: core.num_free_blocks == small.num_kv_blocks - 1, "the pool to empty")


def test_workers_back_with_a_shorter_max_model_len_are_refused_by_name_until_right_ones_come(
        stack, tiny_model_dir):
    engine, core, port, servers = stack
    session = engine.open_session()
    short = runner(tiny_model_dir, kv_cache_memory=1 << 20, max_model_len=64)
    with capture_logs() as logs:
        servers[0].stop(0)
        servers.append(start_worker(short, max_workers=2, port=port)[0])
        engine.add(session, Request("waits", list(PROMPT), SamplingParams(max_tokens=4)))
        wait_for(lambda: engine.num_reconnect_failures >= 1, "a refused reconnect round")
        refused = [e for e in logs if e["event"] == "worker_reconnect_failed"]
        assert "max_model_len 64 is below the scheduler's 256" in refused[0]["error"]
        assert engine.num_worker_reconnects == 0 and core.num_total_blocks == \
            engine.model_info.num_kv_blocks  # nothing adopted
        servers[-1].stop(0)
        servers.append(start_worker(runner(tiny_model_dir, kv_cache_memory=1 << 20),
                                    max_workers=2, port=port)[0])
        assert len(tokens(session, "waits")) == 4
    assert engine.num_worker_reconnects == 1


def test_a_pool_too_small_for_the_longest_request_is_not_adopted():
    cfg = SchedulerConfig(block_size=16, max_model_len=256, max_num_seqs=4,
                          max_num_batched_tokens=256)
    core = Scheduler(cfg, 64)
    with pytest.raises(ConfigError, match="max_model_len 256 needs 16 KV blocks"):
        core.resize_kv_pool(16)  # 15 usable
    assert core.num_total_blocks == 64
    core.resize_kv_pool(17)
    assert (core.num_total_blocks, core.num_free_blocks) == (17, 16)


def test_a_pool_is_not_resized_under_a_request_holding_blocks():
    cfg = SchedulerConfig(block_size=16, max_model_len=256, max_num_seqs=4,
                          max_num_batched_tokens=256)
    core = Scheduler(cfg, 64)
    core.add_request(Request("r", list(PROMPT), SamplingParams(max_tokens=4)))
    core.schedule()
    with pytest.raises(RuntimeError, match="1 requests hold blocks"):
        core.resize_kv_pool(32)
    core.requeue_all_for_recompute()  # what a worker loss does first
    core.resize_kv_pool(32)
    assert core.num_total_blocks == 32
