"""Every port a service listens on is its own (shared/ports.py): a busy one is one
line on stderr naming the port and the flag (and variable) that moves it, and a
non-zero exit before anything is announced; `gapserve serve` checks all of them in
its own flags first, and its health probes accept only its own children (the
instance id), so a second serve never mistakes the first for itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import httpx
import pytest

from gapserve.supervisor import Child
from shared.grpc_server import ServiceServer
from shared.instance import HEADER
from shared.ports import PortUnavailable
from tests.integration.serve_process import port_flags, start_serve
from tests.ports import free_ports


def _hold(port: int) -> socket.socket:
    """A listener of our own on the port (no SO_REUSEPORT, like most programs)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GAPSERVE_")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "gapserve", *argv], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_grpc_service_does_not_share_its_port_with_a_second_server():
    (port,) = free_ports(1)
    first = ServiceServer()
    first.start("127.0.0.1", port)
    try:
        with pytest.raises(PortUnavailable) as refused:
            ServiceServer().start("127.0.0.1", port)
        assert str(refused.value) == (f"port {port} on 127.0.0.1 is already in use; choose "
                                      f"another with --port (or GAPSERVE_PORT)")
        # gRPC's default (SO_REUSEPORT) would have joined a server bound without it
        other = grpc.server(futures.ThreadPoolExecutor(1))
        with pytest.raises(RuntimeError):
            other.add_insecure_port(f"127.0.0.1:{port}")
    finally:
        first.stop(0)


@pytest.mark.parametrize("service, flag", [
    ("worker", "--port"), ("worker", "--metrics-port"), ("scheduler", "--port"),
    ("scheduler", "--metrics-port"), ("frontend", "--http-port"), ("frontend", "--grpc-port")])
def test_a_service_on_a_busy_port_exits_with_one_line_naming_the_port_and_flag(
        tiny_model_dir, service, flag):
    ports = dict(zip(("--port", "--metrics-port", "--http-port", "--grpc-port"), free_ports(4)))
    argv = {"worker": ["--port", "--metrics-port"], "scheduler": ["--port", "--metrics-port"],
            "frontend": ["--http-port", "--grpc-port"]}[service]
    model = ["--model", str(tiny_model_dir)] if service != "scheduler" else []
    with _hold(ports[flag]):
        done = _run(service, *model, *(str(x) for f in argv for x in (f, ports[f])))
    assert done.returncode == 2
    env = "GAPSERVE_" + flag[2:].replace("-", "_").upper()
    assert done.stderr.splitlines() == [
        f"gapserve {service}: port {ports[flag]} on 127.0.0.1 is already in use; choose "
        f"another with {flag} (or {env})"]


def test_the_scheduler_refuses_a_busy_kv_events_port_before_it_announces_anything():
    port, grpc_port = free_ports(2)
    config = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}'
    with _hold(port):
        done = _run("scheduler", "--port", str(grpc_port), "--metrics-port", "0",
                    "--kv-events-config", config)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"gapserve scheduler: port {port} on 0.0.0.0 is already in use; choose another "
        f"with --kv-events-config (or GAPSERVE_KV_EVENTS_CONFIG)"]


def test_serve_refuses_a_busy_inner_port_in_its_own_flag_before_starting_anything(
        tiny_model_dir, tmp_path):
    ports = port_flags()
    with _hold(ports["--scheduler-metrics-port"]):
        serve = start_serve(tiny_model_dir, tmp_path / "serve.log", ports=ports)
        assert serve.wait() == 2
    port = ports["--scheduler-metrics-port"]
    assert serve.lines() == [
        f"gapserve serve: port {port} on 127.0.0.1 is already in use; choose another with "
        f"--scheduler-metrics-port (or GAPSERVE_SCHEDULER_METRICS_PORT)"]


def test_a_second_serve_on_the_same_ports_exits_and_the_first_keeps_serving(
        tiny_model_dir, tmp_path):
    first = start_serve(tiny_model_dir, tmp_path / "first.log")
    try:
        first.wait_ready()
        second = start_serve(tiny_model_dir, tmp_path / "second.log", ports=first.ports)
        assert second.wait() == 2
        (line,) = second.lines()  # no "serving" announcement, no restart loop
        assert line.startswith("gapserve serve: port ") and "already in use" in line
        assert httpx.get(f"http://127.0.0.1:{first.ports['--http-port']}/health",
                         timeout=30).status_code == 200
        assert first.process.poll() is None
    finally:
        first.stop()
    assert first.process.returncode == 0, first.output()[-3000:]


def test_serve_accepts_only_health_answers_with_its_own_instance_id(tiny_model_dir, tmp_path):
    serve = start_serve(tiny_model_dir, tmp_path / "serve.log")
    try:
        serve.wait_ready()
        ready = next(line for line in serve.lines() if line.startswith("gapserve: serving"))
        instance = ready.split("(instance ")[1].rstrip(")")
        http = f"http://127.0.0.1:{serve.ports['--http-port']}/health"
        reply = httpx.get(http, timeout=30)
        assert reply.status_code == 200 and reply.headers[HEADER] == instance
        assert reply.content == b""  # /health's contract for load balancers is unchanged
        for flag in ("--grpc-port", "--scheduler-port", "--worker-port"):
            address = f"127.0.0.1:{serve.ports[flag]}"
            frontend = flag == "--grpc-port"
            assert Child("mine", [], address, http if frontend else None,
                         instance_id=instance).healthy()
            assert not Child("another", [], address, http if frontend else None,
                             instance_id="0" * 16).healthy()
    finally:
        serve.stop()
