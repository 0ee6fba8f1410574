"""The real Shepherd Model Gateway (`smg` 1.13.0 from PyPI, its Rust binary) in gRPC
mode in front of two gapserve replicas (`gapserve serve --data-parallel-size 2`),
speaking `vllm.grpc.engine.VllmEngine` to each replica's scheduler, driven by the
`openai` client. The default model (SmolLM2-135M-Instruct, local) serves, so smg's
chat template and tool parsing meet a real model.

What is shown: smg registers both schedulers as healthy vLLM workers under the served
name; greedy chat through smg equals gapserve's own frontend (same replicas),
streamed and not; turns sharing a system prompt stay on one replica and report
cached tokens; a client that disconnects frees its request; `tool_choice: required`
returns valid calls; a replica's worker SIGKILLed does not stop later requests. The
kill runs last, on this module's processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

# a pinned test dependency (pyproject.toml's test extra): missing, this module fails
# to import, as any missing dependency would, rather than skipping quietly
import smg  # noqa: F401

from shared.proto import engine_pb2, engine_pb2_grpc
from tests.integration.serve_process import Serve, port_flags, start_serve
from tests.ports import free_ports
from tests.integration.test_services import _children
from tests.wire.session_client import wait_for

STRIDE = 7  # replica 1: every inner port + 7
SYSTEM_PROMPT = ("You are the support assistant of a bicycle shop. Answer in one short "
                 "sentence, name the part involved, and never invent prices. " * 3)
TURNS = ["My chain slips.", "The brakes squeal.", "A spoke broke."]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}}


@dataclass(slots=True)
class Fleet:
    serve: subprocess.Popen
    serve_log: Path
    http_port: int
    scheduler_ports: list[int]
    worker_ports: list[int]
    gateway: subprocess.Popen
    gateway_log: Path
    gateway_port: int
    model: str

    def client(self, via_gateway: bool = True) -> openai.OpenAI:
        port = self.gateway_port if via_gateway else self.http_port
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                             max_retries=0, timeout=300)

    def workers(self) -> list[dict]:
        url = f"http://127.0.0.1:{self.gateway_port}/workers"
        return json.loads(urllib.request.urlopen(url, timeout=5).read())["workers"]

    def status(self, i: int) -> engine_pb2.EngineStatus:
        with grpc.insecure_channel(f"127.0.0.1:{self.scheduler_ports[i]}") as channel:
            return engine_pb2_grpc.EngineStub(channel).GetStatus(engine_pb2.GetStatusRequest(),
                                                                 timeout=30)

    def logs(self) -> str:
        return (f"--- serve\n{self.serve_log.read_text(errors='replace')[-3000:]}\n"
                f"--- smg\n{self.gateway_log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from shared.model_files.default_model import ensure_default_model

    model_dir = ensure_default_model()
    logs = tmp_path_factory.mktemp("smg-fleet")
    gateway_port, gateway_metrics = free_ports(2)
    ports = {**port_flags(), "--scheduler-metrics-port": 0, "--worker-metrics-port": 0}
    http, sched, worker = (ports[f] for f in ("--http-port", "--scheduler-port",
                                               "--worker-port"))
    served = start_serve(model_dir, logs / "serve.log", "--data-parallel-size", "2",
                         "--data-parallel-port-stride", str(STRIDE), "--max-model-len", "1024",
                         "--kv-cache-memory", str(96 << 20), "--max-num-seqs", "8",
                         ports=ports)
    serve, serve_log = served.process, served.log
    env = {k: v for k, v in os.environ.items() if not k.startswith("GAPSERVE_")}
    gateway_log = logs / "smg.log"
    gateway = None
    try:
        served.wait_ready()
        schedulers = [sched, sched + STRIDE]
        with open(gateway_log, "wb") as out:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1",
                 "--port", str(gateway_port), "--backend", "vllm",
                 "--worker-urls", *[f"grpc://127.0.0.1:{p}" for p in schedulers],
                 "--model-path", str(model_dir), "--policy", "cache_aware",
                 "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(gateway_metrics),
                 "--log-level", "debug"],
                stdout=out, stderr=subprocess.STDOUT, env={**env, "HF_HUB_OFFLINE": "1"})
        fleet = Fleet(serve, serve_log, http, schedulers, [worker, worker + STRIDE], gateway,
                      gateway_log, gateway_port, model_dir.name)

        def both_healthy() -> bool:
            assert gateway.poll() is None, fleet.logs()
            try:
                workers = fleet.workers()
            except OSError:
                return False  # not listening yet
            return len(workers) == 2 and all(w["is_healthy"] for w in workers)

        wait_for(both_healthy, timeout_s=120, what="smg to register both replicas")
        yield fleet
    finally:
        if gateway is not None:
            Serve(gateway, gateway_log, {}).stop()
        served.stop()


def chat(client, model, turn: str, system: str = SYSTEM_PROMPT, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": turn}],
        max_tokens=12, temperature=0.0, **kw)


def test_smg_registers_both_schedulers_as_healthy_vllm_workers(fleet):
    workers = fleet.workers()
    assert sorted(w["url"] for w in workers) == sorted(
        f"grpc://127.0.0.1:{p}" for p in fleet.scheduler_ports)
    for w in workers:
        assert w["is_healthy"] and w["connection_mode"] == "grpc"
        assert w["runtime_type"] == "vllm" and w["model_id"] == fleet.model
    assert [m.id for m in fleet.client().models.list().data] == [fleet.model]


def test_greedy_chat_through_smg_equals_gapserve_frontend_streamed_and_not(fleet):
    via, direct = fleet.client(), fleet.client(via_gateway=False)
    for turn in ("What is a derailleur?", "Name three colours."):
        want = chat(direct, fleet.model, turn, system="Be brief.").choices[0].message.content
        got = chat(via, fleet.model, turn, system="Be brief.").choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in chat(
            via, fleet.model, turn, system="Be brief.", stream=True) if c.choices)
        assert got == streamed == want


def test_turns_sharing_a_system_prompt_stay_on_one_replica_and_hit_its_cache(fleet):
    client = fleet.client()
    before = [fleet.status(i).prefix_cache_queries for i in range(2)]
    cached = []
    for turn in TURNS:  # one at a time: the tree's longest match decides alone
        usage = chat(client, fleet.model, turn).usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
    queried = [fleet.status(i).prefix_cache_queries - b for i, b in enumerate(before)]
    assert sorted(q > 0 for q in queried) == [False, True], queried  # one replica served all
    assert all(c > 0 for c in cached[1:]), cached  # ...reusing the system prompt's KV


def test_a_client_that_disconnects_frees_its_request(fleet):
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"http://127.0.0.1:{fleet.gateway_port}/v1/chat/completions",
                         json={"model": fleet.model, "stream": True, "max_tokens": 900,
                               "ignore_eos": True, "temperature": 0.0,
                               "messages": [{"role": "user", "content": "Count to a thousand."}]}
                         ) as reply:
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            request_id = json.loads(first[len("data: "):])["id"]
            next(lines)
        # leaving the block closed the connection mid-stream
    # smg's engine request id is the response id plus a suffix of its own

    def ended() -> list[dict]:
        return [e for e in map(json.loads, (line for line in fleet.serve_log.read_text(
            errors="replace").splitlines() if line.startswith("{") and request_id in line))
            if e["event"] in ("vllm_engine_cancelled", "vllm_engine_abort")]

    wait_for(lambda: ended(), timeout_s=120, what="the scheduler to see the cancel or abort")
    wait_for(lambda: all(fleet.status(i).num_running + fleet.status(i).num_waiting == 0
                         for i in range(2)), timeout_s=120, what="the request to be freed")
    assert all(e.get("num_output_tokens", 0) < 900 for e in ended())


def test_tool_choice_required_returns_valid_calls(fleet):
    reply = fleet.client().chat.completions.create(
        model=fleet.model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice="required", max_tokens=200, temperature=0.0)
    calls = reply.choices[0].message.tool_calls
    assert calls, reply
    for call in calls:
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")


def test_a_replica_worker_killed_does_not_stop_later_requests(fleet):
    worker = next(pid for pid in _children(fleet.serve.pid)
                  if f"--port\x00{fleet.worker_ports[0]}\x00".encode()
                  in Path(f"/proc/{pid}/cmdline").read_bytes())
    os.kill(worker, signal.SIGKILL)
    client = fleet.client()
    replies = [chat(client, fleet.model, f"Question {i}: what is a tyre?", system="Be brief.")
               for i in range(4)]
    assert all(r.choices[0].message.content for r in replies)
    assert fleet.gateway.poll() is None and fleet.serve.poll() is None
