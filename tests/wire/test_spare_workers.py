"""Spare worker groups (docs/resilience.md): --worker-addresses lists groups after
`;`. On a worker loss the scheduler's WorkerGroup tries the active group first, then
each spare in order, and takes over only a group that matches what the scheduler
was built for. Workers here are real servicers in this process, over loopback gRPC."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from scheduler_svc.engine_errors import WorkerLost
from scheduler_svc.worker_group import WorkerGroup
from shared import config
from shared.arg_types import address_groups, worker_groups
from shared.grpc_server import ServiceServer
from tests.wire.conftest import start_worker
from worker_svc.config import WorkerConfig

# per group: a dead address costs this much (the handshake waits for it to be ready);
# a live one must answer within it, which a loaded 2-core box can take 0.5 s over
RECONNECT_TIMEOUT_S = 2.0


def parse(argv: list[str], environ: dict[str, str] | None = None):
    return config.parse_args(config.scheduler_parser(), argv, environ=environ or {})


# ---------------------------------------------------------------------------
# the flag


def test_semicolon_separates_worker_groups_and_the_first_is_the_active_one():
    args = parse(["--worker-addresses", "w0:1,w1:2;s0:1,s1:2"])
    assert args.worker_addresses == ["w0:1", "w1:2"]  # what callers read before spares
    assert worker_groups(args.worker_addresses) == [["w0:1", "w1:2"], ["s0:1", "s1:2"]]


def test_a_plain_comma_list_is_one_group_as_before():
    for args in (parse([], {"GAPSERVE_WORKER_ADDRESSES": "a:1, b:2"}),
                 parse(["--worker-addresses", "a:1,b:2"])):
        assert args.worker_addresses == ["a:1", "b:2"]
        assert worker_groups(args.worker_addresses) == [["a:1", "b:2"]]
    assert parse([]).worker_addresses == ["127.0.0.1:50053"]
    assert worker_groups(["x:1"]) == [["x:1"]]  # a plain list from a caller


@pytest.mark.parametrize("value, says", [
    ("a:1,b:2;c:1", "the same number in each, but the groups have [2, 1]"),
    ("a:1;a:1", "a:1 listed more than once"),
    ("a:1;c", "'c' is not host:port"),
    (" ; ", "needs at least one host:port")])
def test_bad_worker_groups_are_a_usage_error(value, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--worker-addresses", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--worker-addresses" in err and says in err


# ---------------------------------------------------------------------------
# reconnect with a spare


@pytest.fixture(scope="module")
def runner_factory(tiny_model_dir):
    from worker_svc.runner import ModelRunner

    def make(kv_cache_memory: int = 4 << 20) -> ModelRunner:
        return ModelRunner(WorkerConfig(model=tiny_model_dir, kv_cache_memory=kv_cache_memory,
                                        max_model_len=256, max_num_seqs=16))
    return make


@pytest.fixture
def servers():
    started: list[ServiceServer] = []
    yield started
    for server in started:
        server.stop(0)


def serve(servers: list, runner, port: int = 0) -> str:
    """A worker over `runner` on loopback (port 0: a free one, else that port again, as
    a restarted container); its address."""
    server, port = start_worker(runner, max_workers=2, port=port)
    servers.append(server)
    return f"127.0.0.1:{port}"


def connected(addresses: str) -> WorkerGroup:
    group = WorkerGroup(address_groups(addresses))
    group.handshake(timeout_s=10)
    group.open_streams()
    return group


def test_reconnect_stays_on_the_active_group_while_it_answers(servers, tiny_runner,
                                                                runner_factory):
    active, spare = serve(servers, tiny_runner), serve(servers, runner_factory())
    group = connected(f"{active};{spare}")
    try:
        group.reconnect(RECONNECT_TIMEOUT_S)
        assert (group.addresses, group.num_failovers) == ([active], 0)
    finally:
        group.close()


def test_reconnect_fails_over_to_the_spare_when_the_active_group_is_gone(
        servers, tiny_runner, runner_factory):
    active, spare = serve(servers, tiny_runner), serve(servers, runner_factory())
    group = connected(f"{active};{spare}")
    try:
        servers[0].stop(0)  # the active worker dies and does not come back
        with capture_logs() as logs:
            info = group.reconnect(RECONNECT_TIMEOUT_S)
        assert (group.addresses, group.num_failovers) == ([spare], 1)
        assert info.num_kv_blocks == group.model_info.num_kv_blocks
        failover = [e for e in logs if e["event"] == "worker_failover"]
        assert failover and failover[0]["from_addresses"] == [active]
        assert failover[0]["to_addresses"] == [spare]
    finally:
        group.close()


def test_failover_is_round_robin_back_to_a_restarted_first_group(servers, tiny_runner,
                                                                   runner_factory):
    active, spare = serve(servers, tiny_runner), serve(servers, runner_factory())
    group = connected(f"{active};{spare}")
    try:
        servers[0].stop(0)
        group.reconnect(RECONNECT_TIMEOUT_S)
        servers[1].stop(0)  # the spare dies too; the first container restarted meanwhile
        serve(servers, runner_factory(), port=int(active.rsplit(":", 1)[1]))
        group.reconnect(RECONNECT_TIMEOUT_S)
        assert (group.addresses, group.num_failovers) == ([active], 2)
    finally:
        group.close()


def test_a_spare_with_another_kv_pool_is_skipped_with_a_log_line_unless_accepted(
        servers, tiny_runner, runner_factory):
    active = serve(servers, tiny_runner)
    spare_runner = runner_factory(kv_cache_memory=2 << 20)  # fewer KV blocks
    spare = serve(servers, spare_runner)
    group = connected(f"{active};{spare}")
    try:
        servers[0].stop(0)
        with capture_logs() as logs, pytest.raises(WorkerLost) as e:
            group.reconnect(RECONNECT_TIMEOUT_S)  # nobody to judge another pool: refused
        assert f"a KV pool of {spare_runner.num_kv_blocks} blocks" in str(e.value)
        with pytest.raises(WorkerLost, match="too small, says the scheduler"):
            group.reconnect(RECONNECT_TIMEOUT_S, accept=lambda info: "too small, says the scheduler")
        assert group.addresses == [active]  # nothing switched
        skipped = [x for x in logs if x["event"] == "worker_group_skipped"]
        assert skipped and skipped[0]["addresses"] == [spare]
        # the engine's judge (tests/wire/test_pool_after_loss.py) takes a pool that fits
        info = group.reconnect(RECONNECT_TIMEOUT_S, accept=lambda info: None)
        assert (group.addresses, info.num_kv_blocks) == ([spare], spare_runner.num_kv_blocks)
    finally:
        group.close()
