"""The pods the chart renders, run as local processes with the tiny model: each
container's args and environment as the kubelet would start it (one token for every
reference to the token Secret), the cluster's DNS names pointed at loopback, and the
chart's own probes executed against them. What Kubernetes adds (scheduling, the
network, the images) is the only thing left out."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from shared.grpc_server import check_health
from shared.link_security import TOKEN_METADATA
from shared.proto import engine_pb2, engine_pb2_grpc
from tests.ports import free_ports
from tests.integration.tiny_model import tiny_llama_dir

from .compose_file import ROOT
from .helm_chart import as_the_kubelet_starts_it, install

START_ORDER = ("worker", "scheduler", "frontend")
STARTUP_TIMEOUT_S = 300.0
SVC_HOST = re.compile(r"[a-z0-9.-]+\.svc\b")


def probe_passes(probe: dict, container: dict) -> bool:
    """One probe as the kubelet runs it: HTTP 200-399, gRPC SERVING, or a TCP connect."""
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    kind = next(k for k in ("httpGet", "grpc", "tcpSocket") if k in probe)
    port = probe[kind]["port"]
    port = named.get(port, port)
    if kind == "grpc":
        return check_health(f"127.0.0.1:{port}", timeout_s=probe.get("timeoutSeconds", 1),
                            service=probe["grpc"].get("service", ""))
    if kind == "tcpSocket":
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe['httpGet']['path']}",
                                    timeout=probe.get("timeoutSeconds", 1)) as reply:
            return 200 <= reply.status < 400
    except (urllib.error.URLError, OSError):
        return False


class Pods:
    def __init__(self, rendered, token: str, log_dir: Path) -> None:
        self.containers = {c: spec["containers"][0] for c, spec in rendered.pod_specs().items()}
        self.token = token
        self.log_dir = log_dir
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, component: str) -> None:
        args, env = as_the_kubelet_starts_it(self.containers[component], {}, pod_index=0,
                                             secret=self.token)
        # the pod's address and the cluster's DNS names are loopback here
        env = {k: SVC_HOST.sub("127.0.0.1", v) for k, v in env.items()}
        env["GAPSERVE_HOST"] = "127.0.0.1"
        base = {k: v for k, v in os.environ.items() if not k.startswith("GAPSERVE_")}
        base.update(OMP_NUM_THREADS="1", GAPSERVE_CACHE_DIR=os.environ.get(
            "GAPSERVE_CACHE_DIR", str(Path.home() / ".cache" / "gapserve")))
        with open(self.log_dir / f"{component}.log", "wb") as log:
            self.processes[component] = subprocess.Popen(
                [sys.executable, "-m", "gapserve", *args], cwd=ROOT, env={**base, **env},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_started(self, component: str) -> None:
        """Until the startup probe passes (polled faster than the kubelet would), or
        its budget (period x failure threshold) or our timeout runs out."""
        probe = self.containers[component]["startupProbe"]
        budget = probe["periodSeconds"] * probe["failureThreshold"]
        deadline = time.monotonic() + min(budget, STARTUP_TIMEOUT_S)
        while not probe_passes(probe, self.containers[component]):
            process = self.processes[component]
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{component} did not start ({process.returncode}):\n"
                                   f"{self.logs()}")
            time.sleep(0.5)  # the kubelet's own cadence is periodSeconds

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> dict[str, int]:
        codes = {}
        for component in reversed(list(self.processes)):
            process = self.processes[component]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            codes[component] = process.returncode
        return codes


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    http, grpc_port, sched, sched_metrics, worker, worker_metrics, rendezvous = free_ports(7)
    rendered = install({
        "model": str(tiny_llama_dir()), "drainTimeoutS": 1,
        "limits": {"maxModelLen": 512, "maxNumSeqs": 64, "maxNumBatchedTokens": 512},
        "frontend": {"replicas": 1, "httpPort": http, "grpcPort": grpc_port},
        "scheduler": {"port": sched, "metricsPort": sched_metrics},
        "worker": {"port": worker, "metricsPort": worker_metrics,
                   "rendezvousPort": rendezvous, "kvCacheMemory": 8 << 20}})
    running = Pods(rendered, secrets.token_urlsafe(24), tmp_path_factory.mktemp("helm-pods"))
    try:
        # the order a cluster settles into; each waits for its own startup probe
        for component in START_ORDER:
            running.start(component)
            running.wait_started(component)
        yield running
    finally:
        running.stop()


def test_every_rendered_probe_passes_once_the_pods_started(pods):
    for component, container in pods.containers.items():
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe_passes(container[kind], container), f"{component} {kind}\n{pods.logs()}"


def test_the_rendered_frontend_answers_a_chat_completion(pods):
    import openai
    port = pods.containers["frontend"]["ports"][0]["containerPort"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens >= 1


def test_the_scheduler_refuses_a_caller_without_the_token_from_the_secret(pods):
    port = pods.containers["scheduler"]["ports"][0]["containerPort"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10,
                       metadata=[(TOKEN_METADATA, pods.token)])


def test_the_rendered_pods_drain_and_exit_cleanly_on_sigterm(pods):
    # last in this module: Kubernetes stops a pod with SIGTERM, then waits
    # terminationGracePeriodSeconds
    assert pods.stop() == {"frontend": 0, "scheduler": 0, "worker": 0}, pods.logs()
