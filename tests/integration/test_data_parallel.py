"""Data parallelism behind the frontend's own routing, the real services on loopback
(docs/deploy.md, "Data parallelism and routing"): two replicas (worker + scheduler
each, the tiny model, KV events on private ipc sockets) started separately, as one
scheduler Service per replica would be, and one frontend given their addresses.

Greedy tokens through the two equal transformers'; a shared prefix goes to the
replica whose KV events say it holds it (the routing counters and cached_tokens
say so) although the fallback rule would pick the other; with the overload rule's
thresholds set low (a second frontend on the same replicas), a request whose prefix
one replica holds goes to the other while the holder is busy; killing one replica's
scheduler mid-stream loses no stream (every stream ends with the text of the
no-fault run, the failover is counted) and the replica rejoins when it is back;
/v1/status and `gapserve status` list the replicas."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from gapserve import status as status_cli
from gapserve.supervisor import Child, Supervisor
from shared.proto import common_pb2, generate_pb2
from tests.integration.conftest import STARTUP_TIMEOUT_S, TINY_FLAGS, Stack, start_stack
from tests.ports import free_ports
from tests.integration.hf_reference import hf_greedy
from tests.wire.session_client import wait_for

NUM_STREAMS = 8
STREAM_TOKENS = 128  # long enough that the kill lands mid-stream on any machine


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


class DataParallel:
    def __init__(self, model_dir: Path, root: Path) -> None:
        self.sockets = tempfile.mkdtemp(prefix="gapserve-dp-test-")  # short ipc paths
        self.replicas: list[Stack] = []
        self.kv = [f"ipc://{self.sockets}/kv-{i}" for i in range(2)]
        self.replay = [f"ipc://{self.sockets}/replay-{i}" for i in range(2)]
        def replica(i: int) -> Stack:
            cfg = {"enable_kv_cache_events": True, "endpoint": self.kv[i],
                   "replay_endpoint": self.replay[i]}
            return start_stack(model_dir, root / f"replica-{i}", services=("worker", "scheduler"),
                               flags=[*TINY_FLAGS, "--kv-events-config", json.dumps(cfg)])

        with ThreadPoolExecutor(2) as pool:  # both start at once, as two pods would
            futures = [pool.submit(replica, i) for i in range(2)]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for f in futures:
                if f.exception() is None:
                    f.result().stop()
            raise failed[0]
        self.replicas = [f.result() for f in futures]
        self.model_dir, self.root = model_dir, root
        self.front = self.frontend("frontend")
        wait_for(lambda: all(r["in_routing"] for r in self.status()["replicas"]),
                 timeout_s=60, what="both replicas in routing")

    def frontend(self, name: str, *flags: str) -> Stack:
        """A frontend over both replicas (their schedulers and KV events)."""
        http, grpc_port = free_ports(2)
        front = Child("frontend", [
            "frontend", "--model", str(self.model_dir), "--http-port", str(http),
            "--grpc-port", str(grpc_port), "--log-format", "json",
            "--scheduler-addresses", ",".join(r.scheduler_address for r in self.replicas),
            "--kv-events-endpoints", ",".join(self.kv),
            "--kv-events-replay-endpoints", ",".join(self.replay), *flags],
            f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http}/health")
        supervisor = Supervisor([front])
        env = {k: v for k, v in os.environ.items() if not k.startswith("GAPSERVE_")}
        env["OMP_NUM_THREADS"] = "1"
        (self.root / name).mkdir(parents=True, exist_ok=True)
        supervisor.start(self.root / name, env)
        stack = Stack(self.model_dir, self.root / name, http, grpc_port,
                      self.replicas[0].scheduler_port, self.replicas[0].worker_port, supervisor)
        problem = supervisor.wait_healthy(STARTUP_TIMEOUT_S)
        if problem is not None:
            stack.stop()
            self.stop()
            raise RuntimeError(f"the frontend did not start: {problem}\n{stack.logs()}")
        return stack

    def status(self, front: Stack | None = None) -> dict:
        front = front or self.front
        return httpx.get(front.http_url + "/v1/status", timeout=30).json()

    def routed(self, front: Stack | None = None, reason: str | None = None) -> dict[str, float]:
        """gapserve:requests_routed_total by replica (every reason summed, or one)."""
        out: dict[str, float] = {}
        front = front or self.front
        for line in httpx.get(front.http_url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("gapserve:requests_routed_total{") and (
                    reason is None or f'reason="{reason}"' in line):
                replica = line.split('replica="', 1)[1].split('"', 1)[0]
                out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def metric(self, name: str) -> float:
        text = httpx.get(self.front.http_url + "/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def stop(self) -> None:
        self.front.stop()
        for r in self.replicas:
            r.stop()
        shutil.rmtree(self.sockets, ignore_errors=True)


@pytest.fixture(scope="module")
def dp(tiny_model_dir, tmp_path_factory):
    stack = DataParallel(tiny_model_dir, tmp_path_factory.mktemp("data-parallel"))
    yield stack
    stack.stop()


def generate_ids(stack: Stack, prompt: list[int], n: int) -> list[int]:
    replies = stack.generation_stub().Generate(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True)), timeout=120)
    return [t for r in replies for t in r.token_ids]


def test_greedy_tokens_through_two_replicas_equal_transformers(dp, hf_tiny):
    prompts = [[1, 504 + 7 * i, 3209, 28, 253 + i, 4821, 99, 17 + i] for i in range(6)]
    before = dp.routed()
    got: list = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(
        i, generate_ids(dp.front, prompts[i], 12))) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf_tiny, prompt, 12)
    after = dp.routed()
    assert sum(after.values()) - sum(before.values()) == len(prompts)


def test_a_shared_prefix_goes_to_the_replica_whose_events_hold_it(dp):
    client = dp.front.openai(timeout=120.0)
    system = " ".join(f"rule {i}: answer in the style of document {i * 7}." for i in range(12))
    first = client.completions.create(model=dp.front.served_model_name,
                                      prompt=system + " Question 0?", max_tokens=2,
                                      temperature=0.0)
    assert first.usage.prompt_tokens > 64
    # the replica that took it: the one whose index now holds the prefix's blocks
    wait_for(lambda: any((r["cached_blocks"] or 0) >= 4 for r in dp.status()["replicas"]),
             timeout_s=30, what="the prefix's KV events")
    rows = dp.status()["replicas"]
    holder = max(rows, key=lambda r: r["cached_blocks"])
    other = next(r for r in rows if r is not holder)
    assert holder["cached_blocks"] > other["cached_blocks"]  # fallback would pick `other`
    before = dp.routed()
    for q in range(1, 5):
        reply = client.completions.create(model=dp.front.served_model_name,
                                          prompt=system + f" Question {q}?", max_tokens=2,
                                          temperature=0.0)
        assert reply.usage.prompt_tokens_details.cached_tokens >= 64  # a hit there
    after = dp.routed()
    gained = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert gained.get(str(holder["replica"])) == 4 and gained.get(str(other["replica"]), 0) == 0
    assert dp.metric("gapserve:routed_prefix_tokens_count") >= 4
    assert dp.metric("gapserve:replicas_in_routing") == 2


@pytest.fixture(scope="module")
def low_balance(dp):
    """A second frontend on the same replicas whose overload rule fires at any
    difference: the busiest has more in flight than the idlest (by more than 0, and
    more than 1.0 times it)."""
    front = dp.frontend("frontend-balance", "--routing-balance-abs-threshold", "0",
                        "--routing-balance-rel-threshold", "1.0")
    wait_for(lambda: all(r["in_routing"] for r in dp.status(front)["replicas"]),
             timeout_s=60, what="both replicas in routing behind the second frontend")
    yield front
    front.stop()


def test_the_overload_rule_sends_a_held_prefix_to_the_idle_replica(dp, low_balance):
    """Through 2 real replicas: the replica holding a prompt's prefix has a request in
    flight (its worker is stopped, so that request cannot finish under the test) and
    the other none, so the next request with that prefix goes to the other, reason
    `balance`, although its prefix match there is 0."""
    front = low_balance
    client = front.openai(timeout=120.0)
    system = " ".join(f"clause {i}: reply as the archive of volume {i * 11} would." for i in
                      range(12))

    def complete(q: int, max_tokens: int = 2):
        return client.completions.create(model=front.served_model_name,
                                         prompt=system + f" Query {q}?", max_tokens=max_tokens,
                                         temperature=0.0, extra_body={"ignore_eos": True})

    before = {r["replica"]: r["cached_blocks"] or 0 for r in dp.status(front)["replicas"]}
    assert complete(0).usage.prompt_tokens > 64
    wait_for(lambda: any((r["cached_blocks"] or 0) >= before[r["replica"]] + 4
                         for r in dp.status(front)["replicas"]),
             timeout_s=30, what="the prefix's KV events at the second frontend")
    holder = max(dp.status(front)["replicas"],
                 key=lambda r: (r["cached_blocks"] or 0) - before[r["replica"]])["replica"]
    other = 1 - holder
    worker = next(c for c in dp.replicas[holder].supervisor.children
                  if c.name.startswith("worker"))
    balance_before = dp.routed(front, "balance")
    prefix_before = dp.routed(front, "prefix")
    busy: list = []
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        pinned = threading.Thread(target=lambda: busy.append(complete(1, max_tokens=4)))
        pinned.start()  # -> the holder, by prefix: it cannot finish while its worker stops
        wait_for(lambda: dp.status(front)["replicas"][holder]["in_flight"] == 1,
                 timeout_s=30, what="a request in flight at the holder")
        assert dp.routed(front, "prefix").get(str(holder), 0) \
            == prefix_before.get(str(holder), 0) + 1
        reply = complete(2)  # the holder 1 in flight, the other 0: the other takes it
        assert reply.choices[0].finish_reason == "length"
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)
    pinned.join(120)
    assert busy and busy[0].choices[0].finish_reason == "length"
    after = dp.routed(front, "balance")
    assert after.get(str(other), 0) == balance_before.get(str(other), 0) + 1
    assert after.get(str(holder), 0) == balance_before.get(str(holder), 0)
    log = (front.log_dir / "frontend.log").read_text()
    routed = [json.loads(line) for line in log.splitlines() if '"routed"' in line]
    last = routed[-1]
    assert (last["replica"], last["reason"], last["matched_blocks"]) == (other, "balance", 0)
    seen = {c["replica"]: c for c in last["candidates"]}
    assert seen[holder]["load"] == 1 and seen[holder]["matched_blocks"] >= 4
    assert seen[other]["load"] == 0


def test_status_and_the_status_command_list_the_replicas(dp, capsys):
    rows = dp.status()["replicas"]
    assert [r["replica"] for r in rows] == [0, 1]
    assert [r["address"] for r in rows] == [r.scheduler_address for r in dp.replicas]
    assert all(r["in_routing"] and r["kv_events"] for r in rows)
    assert status_cli.main(["--url", dp.front.http_url]) == 0
    out = capsys.readouterr().out
    for r in dp.replicas:
        assert r.scheduler_address in out


class Streams:
    """NUM_STREAMS greedy streams on threads; records text, chunks, errors."""

    def __init__(self, stack: Stack) -> None:
        self.client = stack.openai(timeout=120.0)
        self.text = [""] * NUM_STREAMS
        self.chunks = [0] * NUM_STREAMS
        self.finish: list = [None] * NUM_STREAMS
        self.errors: list[BaseException] = []
        self.model = stack.served_model_name
        self.threads = [threading.Thread(target=self._one, args=(i,), daemon=True)
                        for i in range(NUM_STREAMS)]
        for t in self.threads:
            t.start()

    def _one(self, i: int) -> None:
        try:
            for chunk in self.client.completions.create(
                    model=self.model, prompt=f"Stream {i}: the harbour at dawn was",
                    max_tokens=STREAM_TOKENS, stream=True, temperature=0.0,
                    extra_body={"ignore_eos": True}):
                self.text[i] += chunk.choices[0].text
                self.chunks[i] += 1
                self.finish[i] = chunk.choices[0].finish_reason or self.finish[i]
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.errors.append(e)

    def join(self) -> None:
        for t in self.threads:
            t.join(180)
        assert not any(t.is_alive() for t in self.threads), f"streams hung: {self.chunks}"
        assert not self.errors, self.errors
        assert self.finish == ["length"] * NUM_STREAMS


@pytest.fixture(scope="module")
def reference(dp) -> list[str]:
    """The streams' text without a fault (greedy: whichever replica runs them)."""
    run = Streams(dp.front)
    run.join()
    return run.text


def test_killing_one_replicas_scheduler_mid_stream_loses_no_stream(dp, reference):
    failovers = dp.metric("gapserve:replica_failovers_total")
    run = Streams(dp.front)
    wait_for(lambda: min(run.chunks) >= 2, timeout_s=60, what="every stream under way")
    victim = dp.replicas[0].supervisor
    scheduler = next(c for c in victim.children if c.name == "scheduler")
    scheduler.process.kill()
    scheduler.process.wait()
    assert run.finish.count("length") < NUM_STREAMS  # the kill landed mid-stream
    run.join()
    assert run.text == reference  # greedy: the no-fault text, whichever replica
    assert dp.metric("gapserve:replica_failovers_total") > failovers
    log = (dp.front.log_dir / "frontend.log").read_text()
    assert '"replica_failover"' in log
    # back: it rejoins routing
    victim.launch(scheduler)
    wait_for(lambda: all(r["in_routing"] for r in dp.status()["replicas"]),
             timeout_s=60, what="the restarted replica back in routing")
    assert dp.metric("gapserve:replicas_in_routing") == 2


def test_killing_one_replicas_worker_mid_stream_loses_no_stream(dp, reference):
    """The scheduler stays up but reports NOT_SERVING: its requests are aborted there
    and continue on the other replica, rather than waiting for a new worker."""
    failovers = dp.metric("gapserve:replica_failovers_total")
    run = Streams(dp.front)
    wait_for(lambda: min(run.chunks) >= 2, timeout_s=60, what="every stream under way")
    victim = dp.replicas[1].supervisor
    worker = next(c for c in victim.children if c.name.startswith("worker"))
    worker.process.kill()
    worker.process.wait()
    assert run.finish.count("length") < NUM_STREAMS
    run.join()
    assert run.text == reference
    assert dp.metric("gapserve:replica_failovers_total") > failovers
    victim.launch(worker)  # its scheduler reconnects, SERVING again: back in routing
    wait_for(lambda: all(r["in_routing"] for r in dp.status()["replicas"]),
             timeout_s=60, what="the replica back in routing")
    # nothing is left behind on the replica that lost its worker
    wait_for(lambda: (lambda s: s.num_running == 0 and s.num_waiting == 0)(
        dp.replicas[1].engine_status()), timeout_s=30, what="replica 1 idle")
