"""docker-compose.yml's data-parallel equivalents: the `dp2` profile (deploy/dp2.env:
a second scheduler + worker group, the frontend routing between both by their KV
events) and the `router` profile (deploy/router.env: each replica with its own
frontend behind sglang-router). Both off by default. The last test starts the dp2
stack as local processes (tests/deploy/local_stack.py) with the default model."""

from __future__ import annotations

import json
import re
import time

import httpx

import pytest

from shared import config
from shared.flag_spec import env_name

from .cli_parsers import subcommand_parsers
from .compose_file import (DP2_ENV_PATH, ROOT, ROUTER_ENV_PATH, environment,
                           gapserve_services, load_compose, prometheus_targets)
from .local_stack import LocalStack

DP_SERVICES = {"worker-dp1", "scheduler-dp1"}
DEFAULT, DP2, ROUTED = load_compose(), load_compose(DP2_ENV_PATH), load_compose(ROUTER_ENV_PATH)


def _endpoint(text: str) -> tuple[str, int]:
    host, port = re.fullmatch(r"tcp://([\w.*-]+):(\d+)", text).groups()
    return host, int(port)


def test_without_a_profile_one_replica_and_no_kv_events():
    services = DEFAULT["services"]
    assert not (DP_SERVICES | {"frontend-dp1", "sglang-router"}) & set(services)
    front = environment(services["frontend"])
    assert front["GAPSERVE_SCHEDULER_ADDRESSES"] == "scheduler:50052"
    assert front["GAPSERVE_KV_EVENTS_ENDPOINTS"] == ""
    assert front["GAPSERVE_KV_EVENTS_REPLAY_ENDPOINTS"] == ""
    assert environment(services["scheduler"])["GAPSERVE_KV_EVENTS_CONFIG"] == ""


@pytest.mark.parametrize("doc", [DP2, ROUTED], ids=["dp2", "router"])
def test_each_service_of_the_profile_parses_its_command_and_reads_every_variable(doc):
    parsers = subcommand_parsers()
    for name, svc in gapserve_services(doc).items():
        env = environment(svc)
        parser = parsers[svc["command"][0]]
        config.parse_args(parser, svc["command"][1:], environ=env)  # a usage error exits
        reads = {env_name(f) for a in parser._actions for f in a.option_strings[:1]
                 if f.startswith("--") and not f.startswith("--no-")}
        assert {k for k in env if not k.startswith("OTEL_")} <= reads, name


def test_dp2_gives_the_frontend_every_replicas_scheduler_and_kv_event_sockets():
    services = gapserve_services(DP2)
    assert set(services) == {"worker", "scheduler", "frontend"} | DP_SERVICES
    front = environment(services["frontend"])
    schedulers = front["GAPSERVE_SCHEDULER_ADDRESSES"].split(",")
    events = front["GAPSERVE_KV_EVENTS_ENDPOINTS"].split(",")
    replays = front["GAPSERVE_KV_EVENTS_REPLAY_ENDPOINTS"].split(",")
    assert len(schedulers) == len(events) == len(replays) == 2
    assert front["GAPSERVE_DATA_PARALLEL_ROUTING"] == "kv-aware"
    workers = set()
    for address, event, replay in zip(schedulers, events, replays):
        host, port = address.split(":")
        env = environment(services[host])
        assert services[host]["command"] == ["scheduler"] and env["GAPSERVE_PORT"] == port
        # the frontend dials the sockets this scheduler binds
        cfg = json.loads(env["GAPSERVE_KV_EVENTS_CONFIG"])
        assert cfg["enable_kv_cache_events"] is True
        assert _endpoint(event) == (host, _endpoint(cfg["endpoint"])[1])
        assert _endpoint(replay) == (host, _endpoint(cfg["replay_endpoint"])[1])
        workers.add(env["GAPSERVE_WORKER_ADDRESSES"])
    assert workers == {"worker:50053", "worker-dp1:50053"}  # a group each, none shared


def test_the_router_profile_puts_sglang_router_before_one_frontend_per_replica():
    from sglang_router.launch_router import parse_router_args

    services = ROUTED["services"]
    gapserve = gapserve_services(ROUTED)
    assert set(gapserve) == {"worker", "scheduler", "frontend", "frontend-dp1"} | DP_SERVICES
    router = services["sglang-router"]
    args = parse_router_args(router["command"])  # sglang-router's own argument parser
    assert args.policy == "cache_aware"
    urls = set()
    for name in ("frontend", "frontend-dp1"):
        env = environment(gapserve[name])
        [address] = env["GAPSERVE_SCHEDULER_ADDRESSES"].split(",")  # its own replica only
        assert gapserve[address.split(":")[0]]["command"] == ["scheduler"]
        assert env.get("GAPSERVE_KV_EVENTS_ENDPOINTS", "") == ""
        urls.add(f"http://{name}:{env['GAPSERVE_HTTP_PORT']}")
    assert set(args.worker_urls) == urls
    assert {d for d in router["depends_on"]} == {"frontend", "frontend-dp1"}
    assert ("127.0.0.1", 30000, 30000) in [
        (p.split(":")[0], int(p.split(":")[1]), int(p.split(":")[2])) for p in router["ports"]]


def test_the_router_image_installs_the_pinned_sglang_router():
    dockerfile = (ROOT / "deploy" / "sglang-router" / "Dockerfile").read_text()
    pinned = re.search(r'"sglang-router==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert f"sglang-router=={pinned.group(1)}" in dockerfile
    assert ROUTED["services"]["sglang-router"]["build"]["context"] == "deploy/sglang-router"


@pytest.mark.e2e
def test_the_dp2_stack_routes_a_shared_prefix_to_one_replica_and_both_serve(tmp_path):
    from openai import OpenAI

    from shared.model_files.default_model import ensure_default_model
    ensure_default_model()
    stack = LocalStack(load_compose(DP2_ENV_PATH), tmp_path)
    try:
        stack.start()
        stack.wait_healthy("frontend")
        for name in DP_SERVICES:
            stack.wait_healthy(name)
        port = int(environment(stack.doc["services"]["frontend"])["GAPSERVE_HTTP_PORT"])
        base = f"http://{stack.ports.address('frontend', port)}"
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

        def replicas() -> list[dict]:
            return httpx.get(base + "/v1/status", timeout=10).json()["replicas"]
        deadline = time.monotonic() + 120
        # /health passes once one replica joined; /ready once both did (docs/scale_out.md)
        while httpx.get(base + "/ready", timeout=10).status_code != 200 \
                or not all(r.get("num_running") is not None for r in replicas()):
            assert time.monotonic() < deadline, replicas()  # replica 1 joins on its own
            time.sleep(0.5)  # spaces the polls of its status
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, max_tokens=8, temperature=0.0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        assert len(replicas()) == 2
        # Prometheus (deploy/prometheus.yml) finds every running replica's services
        scraped = {t for t in prometheus_targets() if t.split(":")[0] in stack.services}
        assert {"scheduler-dp1:8001", "worker-dp1:8002"} <= scraped
        for target in scraped:
            host, container_port = target.split(":")
            resp = httpx.get(f"http://{stack.ports.address(host, int(container_port))}"
                             "/metrics", timeout=10)
            assert resp.status_code == 200 and "# TYPE gapserve:" in resp.text, target
    finally:
        stack.stop()


@pytest.mark.e2e
def test_the_router_profile_serves_through_sglang_router_to_both_frontends(tmp_path):
    from openai import OpenAI

    from shared.model_files.default_model import ensure_default_model
    ensure_default_model()
    stack = LocalStack(load_compose(ROUTER_ENV_PATH), tmp_path)
    try:
        stack.start()  # the router last: it waits for both frontends to be healthy
        base = f"http://{stack.ports.address('sglang-router', 30000)}"
        deadline = time.monotonic() + 60
        while True:  # the router's own view: both frontends registered and healthy
            try:
                workers = httpx.get(base + "/workers", timeout=5).json()["workers"]
            except httpx.HTTPError:
                workers = []
            if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                break
            assert time.monotonic() < deadline, stack.services["sglang-router"].log_tail()
            time.sleep(0.5)  # spaces the polls
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        [model] = client.models.list().data  # the served name, from our /server_info
        reply = client.chat.completions.create(
            model=model.id, max_tokens=8, temperature=0.0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        stack.stop()
