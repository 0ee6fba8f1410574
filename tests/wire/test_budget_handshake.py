"""The scheduler and the workers agree on the step token budget: the worker profiled
its activation memory with its budget, so the handshake refuses any other one, and a
scheduler given no budget adopts the worker's (docs/scheduling.md's device-based default)."""

from types import SimpleNamespace

import grpc
import pytest
import torch

from scheduler_svc.server import WorkerGroup, scheduler_config
from shared import config as flags
from tests.wire.conftest import start_worker
from worker_svc.runner import default_max_num_batched_tokens


@pytest.fixture
def worker_address(tiny_runner):
    server, port = start_worker(tiny_runner, max_workers=2)
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_default_budget_is_8192_on_gpus_of_70_gib_or_more_else_2048(monkeypatch):
    assert default_max_num_batched_tokens(torch.device("cpu")) == 2048
    for gib, want in ((80, 8192), (70, 8192), (48, 2048)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda _d, gib=gib: SimpleNamespace(total_memory=gib << 30))
        assert default_max_num_batched_tokens(torch.device("cuda", 0)) == want


def test_worker_reports_the_budget_it_profiled_with(worker_address, tiny_runner):
    group = WorkerGroup([worker_address])
    try:
        info = group.handshake(timeout_s=10)
    finally:
        group.close()
    assert info.max_num_batched_tokens == tiny_runner.max_num_batched_tokens == 2048


def test_handshake_refuses_a_scheduler_budget_the_worker_was_not_sized_for(worker_address):
    group = WorkerGroup([worker_address])
    try:
        with pytest.raises(grpc.RpcError) as e:
            group.handshake(timeout_s=10, max_num_batched_tokens=4096)
        assert group.handshake(timeout_s=10, max_num_batched_tokens=2048).block_size == 16
    finally:
        group.close()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--max-num-batched-tokens is 4096" in e.value.details()
    assert "2048" in e.value.details()


def test_scheduler_without_a_budget_flag_adopts_the_workers(worker_address):
    group = WorkerGroup([worker_address])
    try:
        info = group.handshake(timeout_s=10)
    finally:
        group.close()
    args = flags.parse_args(flags.scheduler_parser(), [])
    assert scheduler_config(args, info).max_num_batched_tokens == 2048
    info.max_num_batched_tokens = 8192  # as a worker on a big GPU reports it
    assert scheduler_config(args, info).max_num_batched_tokens == 8192
