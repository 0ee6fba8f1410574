"""Two gapserve replicas (each a full stack: worker, scheduler, frontend) on loopback
behind the real sglang-router (`sglang-router` from PyPI, its Rust binary) with its
cache-aware policy, driven by the `openai` client through the router.

What is shown: the router registers each replica under its served model name (it
reads frontend_svc/api/router_compat.py's /server_info); greedy text through it equals
one engine's and transformers'; a shared prefix stays on one replica (its prefix
cache hits) while concurrent new prompts spread over both; a replica killed
mid-stream cuts that stream (the router does not resume it) and the router's own
health checks take the replica out, after which every request is served by the
other. The last test kills a replica: it runs last, on this module's stacks."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

# a pinned test dependency (pyproject.toml's test extra): missing, this module fails
# to import, as any missing dependency would, rather than skipping quietly
import sglang_router  # noqa: F401

from tests.integration.conftest import EXACT, TINY_FLAGS, Stack, start_stack
from tests.ports import free_ports

# the router's health checker every second, one failure marks a replica unhealthy
# (defaults: 60 s and 3), so the kill test waits seconds, not minutes
ROUTER_FLAGS = ["--policy", "cache_aware", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1", "--log-level", "info"]
ROUTER_START_S = 60.0
UNHEALTHY_WITHIN_S = 30.0
# long enough that the cache-aware tree's match rate (matched / request characters)
# stays far above its 0.3 threshold whatever short turn follows
SYSTEM_PROMPT = ("You are the support assistant of a bicycle shop. Answer in one short "
                 "sentence, name the part involved, and never invent prices. " * 3)
TURNS = ["My chain slips.", "The brakes squeal.", "A spoke broke.", "The tyre is flat."]


@dataclass(slots=True)
class Router:
    process: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=60)

    def workers(self) -> dict[str, dict]:
        """The router's own view of its workers (GET /workers), by URL."""
        body = json.loads(urllib.request.urlopen(self.url + "/workers", timeout=5).read())
        return {w["url"]: w for w in body["workers"]}

    def wait_for(self, what: str, predicate, timeout_s: float) -> dict[str, dict]:
        """Poll /workers until predicate(workers) holds (the router's state is the
        thing waited on; the pause only spaces the polls)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                workers = self.workers()
                if predicate(workers):
                    return workers
            except OSError:
                workers = None  # not listening yet
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"router: {what} did not happen; workers={workers}\n"
                                     f"{self.log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_router(worker_urls: list[str], log_dir: Path) -> Router:
    port, metrics_port = free_ports(2)
    log_path = log_dir / "sglang-router.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # it never fetches a tokenizer here
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
             "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(metrics_port), *ROUTER_FLAGS],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    return Router(proc, port, metrics_port, log_path)


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    stacks = [start_stack(tiny_model_dir, tmp_path_factory.mktemp(f"replica-{i}"),
                          flags=TINY_FLAGS) for i in range(2)]
    yield stacks
    for stack in stacks:
        stack.stop()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    r = start_router([s.http_url for s in replicas], tmp_path_factory.mktemp("router"))
    name = replicas[0].served_model_name
    r.wait_for("both replicas registered and healthy", lambda ws: len(ws) == 2 and all(
        w["is_healthy"] and w["model_id"] == name for w in ws.values()), ROUTER_START_S)
    yield r
    r.stop()


def scrape(stack: Stack) -> dict[str, float]:
    """A replica's /metrics, samples summed over labels, by metric name."""
    text = urllib.request.urlopen(stack.http_url + "/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def served(stacks: list[Stack]) -> list[float]:
    return [scrape(s).get("vllm:request_success_total", 0.0) for s in stacks]


def chat(client, model, turn: str, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM_PROMPT},
                               {"role": "user", "content": turn}],
        max_tokens=8, temperature=0.0, **kw)


def test_router_registers_each_replica_under_its_served_model(router, replicas):
    workers = router.workers()
    name = replicas[0].served_model_name
    for stack in replicas:
        w = workers[stack.http_url]
        assert w["is_healthy"] and w["connection_mode"] == "HTTP"
        assert w["model_id"] == name and w["metadata"]["model_path"] == str(stack.model_dir)
        # the registration read our /server_info: counted on the replica's own /metrics
        assert scrape(stack).get("gapserve:router_probes_total", 0) >= 1
    assert [m.id for m in router.openai().models.list().data] == [name]


def test_greedy_text_through_the_router_equals_one_engine_and_transformers(router, replicas):
    import torch
    from transformers import LlamaForCausalLM

    from frontend_svc.request.tokenizer import TextTokenizer
    from tests.integration.hf_reference import hf_greedy

    via, direct, model = router.openai(), replicas[0].openai(), replicas[0].served_model_name
    prompt, n = "The quick brown fox", 12
    kw = dict(model=model, prompt=prompt, max_tokens=n, temperature=0.0,
              extra_body={"ignore_eos": True})
    text = via.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in via.completions.create(stream=True, **kw))
    assert text == streamed == direct.completions.create(**kw).choices[0].text

    tokenizer = TextTokenizer.from_dir(replicas[0].model_dir)
    hf = LlamaForCausalLM.from_pretrained(replicas[0].model_dir, dtype=torch.float32).eval()
    assert text == tokenizer.decode(hf_greedy(hf, tokenizer.encode(prompt), n))

    reply = chat(via, model, TURNS[0]).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       chat(via, model, TURNS[0], stream=True) if c.choices)
    assert reply == streamed == chat(direct, model, TURNS[0]).choices[0].message.content


def test_a_shared_prefix_stays_on_one_replica_and_new_prompts_spread(router, replicas):
    client, model = router.openai(), replicas[0].served_model_name
    before, hits_before = served(replicas), [scrape(s).get("vllm:prefix_cache_hits_total", 0)
                                             for s in replicas]
    for turn in TURNS:  # one at a time: the tree's longest match decides alone
        chat(client, model, turn)
    delta = [a - b for a, b in zip(served(replicas), before)]
    assert sorted(delta) == [0, len(TURNS)], delta  # every turn on the same replica
    holder = delta.index(len(TURNS))
    hits = scrape(replicas[holder]).get("vllm:prefix_cache_hits_total", 0)
    assert hits > hits_before[holder]  # ...where the system prompt's KV was reused

    # prompts that share nothing: each is a miss, routed to the replica with fewer
    # requests in flight, so requests started together land on both
    start, before = threading.Barrier(8), served(replicas)

    def fresh(i: int) -> None:
        start.wait()
        client.completions.create(model=model, prompt=f"{i * 7919} unrelated {i}",
                                  max_tokens=32, temperature=0.0,
                                  extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(fresh, range(8)))
    delta = [a - b for a, b in zip(served(replicas), before)]
    assert sum(delta) == 8 and min(delta) >= 1, delta


@pytest.mark.e2e
def test_the_default_model_through_the_router_equals_transformers(default_stack,
                                                                  start_stack_factory, tmp_path):
    """The real default model on two replicas behind the router: each prompt's greedy
    text equals transformers' for that prompt alone, whichever replica served it."""
    from transformers import GenerationConfig

    from frontend_svc.request.tokenizer import TextTokenizer
    from tests.integration.hf_reference import greedy_references, until_eos

    second = start_stack_factory(default_stack.model_dir, flags=[
        "--max-model-len", "2048", "--kv-cache-memory", str(256 << 20), *EXACT])
    r = start_router([default_stack.http_url, second.http_url], tmp_path)
    try:
        r.wait_for("both default replicas registered", lambda ws: len(ws) == 2 and all(
            w["is_healthy"] for w in ws.values()), ROUTER_START_S)
        client, model, n = r.openai(), default_stack.served_model_name, 16
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        start = threading.Barrier(len(prompts))

        def one(prompt: str) -> str:
            start.wait()  # together, so the router spreads them over both
            return client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                              temperature=0.0).choices[0].text
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(one, prompts))
    finally:
        r.stop()
    tokenizer = TextTokenizer.from_dir(default_stack.model_dir)
    eos = GenerationConfig.from_pretrained(default_stack.model_dir).eos_token_id
    want = greedy_references(default_stack.model_dir, [tokenizer.encode(p) for p in prompts], n)
    for prompt, text, ids in zip(prompts, texts, want):
        assert text == tokenizer.decode(until_eos(ids, eos)), prompt

def test_a_data_parallel_frontend_reports_a_load_row_per_replica(start_stack_factory,
                                                                  tiny_model_dir, replicas):
    """One frontend over two schedulers (--data-parallel-size 2) is one router worker
    with dp_size 2: /get_load has a row per replica, capacities are summed."""
    stack = start_stack_factory(tiny_model_dir, flags=[
        *TINY_FLAGS, "--data-parallel-size", "2", "--data-parallel-routing", "round-robin"])

    def get(stack_: Stack, path: str):
        return json.loads(urllib.request.urlopen(stack_.http_url + path, timeout=10).read())
    single, double = get(replicas[0], "/server_info"), get(stack, "/server_info")
    assert (single["dp_size"], double["dp_size"]) == (1, 2)
    assert double["max_total_tokens"] == 2 * single["max_total_tokens"] > 0
    assert double["max_running_requests"] == 2 * single["max_running_requests"]
    rows = get(stack, "/get_load")
    assert [r["dp_rank"] for r in rows] == [0, 1]
    assert all(r["num_reqs"] == r["num_waiting_reqs"] == 0 for r in rows)


def test_a_killed_replica_is_taken_out_by_the_routers_health_checks(router, replicas):
    """Runs last: it kills one of the module's replicas."""
    client, model = router.openai(), replicas[0].served_model_name
    stream = iter(client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=400, temperature=0.0,
        stream=True, extra_body={"ignore_eos": True}))
    next(stream)  # in flight on one replica now
    running = [scrape(s).get("vllm:num_requests_running", 0) for s in replicas]
    assert sorted(running) == [0, 1], running
    victim, survivor = (replicas[0], replicas[1]) if running[0] else (replicas[1], replicas[0])
    victim.process("frontend").kill()  # SIGKILL: no drain, the socket just goes
    victim.stop()

    # the router passes the cut through: the stream never reaches its finish reason
    finish = None
    with pytest.raises(openai.APIConnectionError):
        for chunk in stream:
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
    assert finish is None

    router.wait_for("the killed replica marked unhealthy",
                    lambda ws: not ws[victim.http_url]["is_healthy"], UNHEALTHY_WITHIN_S)
    before = served([survivor])[0]
    for turn in TURNS:  # the shared prefix too, wherever its tree pointed
        assert chat(client, model, turn).choices[0].finish_reason in ("stop", "length")
    assert served([survivor])[0] - before == len(TURNS)
    assert router.workers()[survivor.http_url]["is_healthy"]
