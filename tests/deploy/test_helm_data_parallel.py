"""The Helm chart's data parallelism (dataParallelSize, dataParallelRouting) and
sglang-router in front (router.enabled), as rendered by Helm's own library into the
recording API stub (tests/deploy/helm_chart.py); lint and the Kubernetes API schemas
run on these value sets with the others in test_helm_chart.py. Every pod is started
as the kubelet would (its args and environment) through its service's own parser:
gapserve's, or sglang-router's."""

from __future__ import annotations

import functools
import json

from shared import config

from .helm_chart import NAMESPACE, RELEASE, VALUE_SETS, as_the_kubelet_starts_it, install

FULL = f"{RELEASE}-gapserve"


@functools.cache
def rendered(name: str):
    return install(VALUE_SETS[name])


def started(name: str) -> dict[str, tuple[str, object]]:
    """{workload name: (component, parsed args)} of every pod of the value set."""
    from sglang_router.launch_router import parse_router_args

    out = {}
    for component, obj_name, spec in rendered(name).workloads():
        [container] = spec["containers"]
        args, env = as_the_kubelet_starts_it(container, {}, pod_index=1)
        if component == "router":
            out[obj_name] = (component, parse_router_args(args))
        else:
            parser = getattr(config, f"{component}_parser")()
            out[obj_name] = (component, config.parse_args(parser, args[1:], env))
    return out


def _by(parsed: dict, component: str) -> dict:
    return {name: args for name, (c, args) in parsed.items() if c == component}


def test_one_replica_keeps_the_single_engines_names():
    names = {name for _, name, _ in rendered("defaults").workloads()}
    assert names == {f"{FULL}-frontend", f"{FULL}-scheduler", f"{FULL}-worker"}


def test_dp2_runs_an_engine_per_replica_and_the_frontend_routes_by_their_kv_events():
    parsed = started("dp2")
    schedulers, workers = _by(parsed, "scheduler"), _by(parsed, "worker")
    assert set(schedulers) == {f"{FULL}-r0-scheduler", f"{FULL}-r1-scheduler"}
    assert set(workers) == {f"{FULL}-r0-worker", f"{FULL}-r1-worker"}
    [front] = _by(parsed, "frontend").values()
    hosts = [f"{FULL}-r{i}-scheduler.{NAMESPACE}.svc" for i in range(2)]
    assert front.scheduler_addresses == [f"{h}:50052" for h in hosts]
    assert front.data_parallel_routing == "kv-aware"
    assert front.kv_events_endpoints == [f"tcp://{h}:5557" for h in hosts]
    assert front.kv_events_replay_endpoints == [f"tcp://{h}:5558" for h in hosts]
    for i in range(2):
        sched = schedulers[f"{FULL}-r{i}-scheduler"]
        # each scheduler drives its own worker and publishes where the frontend dials
        assert sched.worker_addresses == [
            f"{FULL}-r{i}-worker-0.{FULL}-r{i}-workers.{NAMESPACE}.svc:50053"]
        cfg = json.loads(sched.kv_events_config)
        assert cfg == {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                       "replay_endpoint": "tcp://*:5558"}
        assert workers[f"{FULL}-r{i}-worker"].master_addr.startswith(f"{FULL}-r{i}-worker-0.")


def test_each_replica_selects_only_its_own_pods_and_exposes_its_kv_event_ports():
    r = rendered("dp2")
    for i in range(2):
        service = r.get("Service", f"-r{i}-scheduler")
        assert service["spec"]["selector"]["gapserve.io/replica"] == str(i)
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]}.items() >= {
            "kv-events": 5557, "kv-replay": 5558}.items()
        for kind, suffix in (("Deployment", f"-r{i}-scheduler"), ("StatefulSet", f"-r{i}-worker")):
            obj = r.get(kind, suffix)
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()
            assert labels["gapserve.io/replica"] == str(i)
        workers = r.get("Service", f"-r{i}-workers")
        assert workers["spec"]["selector"]["gapserve.io/replica"] == str(i)


def test_router_puts_sglang_router_in_front_of_one_frontend_per_replica():
    parsed = started("dp2-router-tp2")
    fronts = _by(parsed, "frontend")
    assert set(fronts) == {f"{FULL}-r0-frontend", f"{FULL}-r1-frontend"}
    for i in range(2):
        # a frontend drives its own replica only: the router does the routing
        assert fronts[f"{FULL}-r{i}-frontend"].scheduler_address == \
            f"{FULL}-r{i}-scheduler.{NAMESPACE}.svc:50052"
        assert not fronts[f"{FULL}-r{i}-frontend"].kv_events_endpoints
        assert len(_by(parsed, "scheduler")[f"{FULL}-r{i}-scheduler"].worker_addresses) == 2
    [(name, args)] = _by(parsed, "router").items()
    assert name == f"{FULL}-router" and args.policy == "cache_aware"
    assert args.worker_urls == [f"http://{FULL}-r{i}-frontend.{NAMESPACE}.svc:8000"
                                for i in range(2)]
    r = rendered("dp2-router-tp2")
    assert r.get("Service", "-router")["spec"]["ports"][0]["port"] == 30000
    for i in range(2):  # each frontend Service selects its own replica's frontends
        svc = r.get("Service", f"-r{i}-frontend")
        assert svc["spec"]["selector"]["gapserve.io/replica"] == str(i)
    [router] = [spec for c, _, spec in r.workloads() if c == "router"]
    container = router["containers"][0]
    assert container["image"] == "gapserve-sglang-router:0.3.2"
    assert container["resources"]["limits"]["memory"]
    assert {e["name"]: e["value"] for e in container["env"]}["HF_HUB_OFFLINE"] == "1"
