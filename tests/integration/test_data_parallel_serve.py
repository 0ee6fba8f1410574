"""`gapserve serve --data-parallel-size 2` end to end, the real command: it starts
two replicas (a worker and a scheduler each, on ports one stride apart, KV events on
private ipc sockets) and a frontend routing between them, serves a completion,
lists both replicas in /v1/status, and stops every process on SIGTERM."""

from __future__ import annotations

import signal

import httpx
import openai

from tests.integration.serve_process import port_flags, start_serve
from tests.integration.test_services import _children, _gone


def test_serve_with_two_replicas_routes_between_them(tiny_model_dir, tmp_path):
    stride = 7  # replica 1: every inner port + 7
    ports = {**port_flags(), "--scheduler-metrics-port": 0, "--worker-metrics-port": 0}
    http, sched = ports["--http-port"], ports["--scheduler-port"]
    serve = start_serve(tiny_model_dir, tmp_path / "serve.log", "--data-parallel-size", "2",
                        "--data-parallel-port-stride", str(stride), ports=ports)
    proc, log = serve.process, serve.log
    try:
        serve.wait_ready()
        assert b"on 2 replicas (kv-aware routing)" in log.read_bytes()
        kids = _children(proc.pid)
        assert len(kids) == 5  # 2 workers, 2 schedulers, 1 frontend
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x",
                               max_retries=0, timeout=120)
        done = client.completions.create(model=tiny_model_dir.name, prompt="Hello there",
                                         max_tokens=4, temperature=0.0)
        assert done.choices[0].finish_reason == "length"
        rows = httpx.get(f"http://127.0.0.1:{http}/v1/status", timeout=30).json()["replicas"]
        assert [r["address"] for r in rows] == [f"127.0.0.1:{sched}",
                                                f"127.0.0.1:{sched + stride}"]
        assert all(r["in_routing"] and r["kv_events"].startswith("ipc://") for r in rows)
        assert sum(r["routed"] for r in rows) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert all(_gone(k) for k in kids)
    finally:
        serve.stop()  # a failed assertion: serve stops its children on SIGTERM


def test_each_replica_gets_its_own_ports_and_kv_event_sockets():
    """No processes: what `gapserve serve --data-parallel-size 3` would start."""
    import json

    from gapserve.serve import children, serve_parser
    from shared import config

    args = config.parse_args(serve_parser(), [
        "--model", "/m", "--data-parallel-size", "3", "--tensor-parallel-size", "2",
        "--data-parallel-port-stride", "10"], environ={})
    kids = {c.name: c for c in children(args)}
    assert sorted(kids) == ["frontend", "scheduler-0", "scheduler-1", "scheduler-2",
                            "worker-0-0", "worker-0-1", "worker-1-0", "worker-1-1",
                            "worker-2-0", "worker-2-1"]
    assert kids["worker-2-1"].health_address == "127.0.0.1:50074"  # 50053 + 2*10 + rank 1
    argv = kids["scheduler-1"].argv
    assert argv[argv.index("--port") + 1] == "50062"
    assert argv[argv.index("--worker-addresses") + 1] == "127.0.0.1:50063,127.0.0.1:50064"
    masters = {kids[f"worker-{i}-0"].argv[kids[f"worker-{i}-0"].argv.index("--master-port") + 1]
               for i in range(3)}
    assert len(masters) == 3  # each replica's ranks rendezvous apart
    kv = [json.loads(kids[f"scheduler-{i}"].argv[
        kids[f"scheduler-{i}"].argv.index("--kv-events-config") + 1])["endpoint"]
        for i in range(3)]
    front = kids["frontend"].argv
    assert front[front.index("--scheduler-addresses") + 1] == \
        "127.0.0.1:50052,127.0.0.1:50062,127.0.0.1:50072"
    assert front[front.index("--kv-events-endpoints") + 1].split(",") == kv
    assert len(set(kv)) == 3 and all(e.startswith("ipc://") for e in kv)
    # a given --kv-events-config: its tcp ports move by the stride, dialled on loopback
    args = config.parse_args(serve_parser(), [
        "--model", "/m", "--data-parallel-size", "2", "--kv-events-config",
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}'], environ={})
    front = next(c for c in children(args) if c.name == "frontend").argv
    assert front[front.index("--kv-events-endpoints") + 1] == \
        "tcp://127.0.0.1:5557,tcp://127.0.0.1:5657"
    assert front[front.index("--kv-events-replay-endpoints") + 1] == \
        "tcp://127.0.0.1:5558,tcp://127.0.0.1:5658"
    # round-robin needs no events
    args = config.parse_args(serve_parser(), [
        "--model", "/m", "--data-parallel-size", "2", "--data-parallel-routing",
        "round-robin"], environ={})
    front = next(c for c in children(args) if c.name == "frontend").argv
    assert "--kv-events-endpoints" not in front
    assert front[front.index("--data-parallel-routing") + 1] == "round-robin"
    # --api-server-count still works: every frontend process fronts every replica
    args = config.parse_args(serve_parser(), [
        "--model", "/m", "--data-parallel-size", "2", "--api-server-count", "2"], environ={})
    fronts = [c for c in children(args) if c.name.startswith("frontend")]
    assert len(fronts) == 2 and len({c.env["PROMETHEUS_MULTIPROC_DIR"] for c in fronts}) == 1
    for c in fronts:
        assert c.argv[c.argv.index("--scheduler-addresses") + 1] == \
            "127.0.0.1:50052,127.0.0.1:50152"


def test_a_stride_that_would_overlap_the_replicas_ports_is_refused(capsys):
    import pytest

    from gapserve import serve

    with pytest.raises(SystemExit) as exc:
        serve.main(["--data-parallel-size", "2", "--tensor-parallel-size", "2",
                    "--data-parallel-port-stride", "2"])
    assert exc.value.code == 2
    assert "--data-parallel-port-stride 2 must exceed --tensor-parallel-size 2" in \
        capsys.readouterr().err
