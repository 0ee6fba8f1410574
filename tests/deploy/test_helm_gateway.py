"""The Helm chart's `gateway` (the Shepherd Model Gateway in front, docs/scale_out.md,
"smg in front"), as rendered by Helm's own library into the recording API stub
(tests/deploy/helm_chart.py): one pod runs `gapserve serve --data-parallel-size N`
with its inner services on the pod's loopback and no token (smg cannot send one) and
smg beside it, dialing each replica's scheduler. Each container starts, as the kubelet
would, through its own parser: gapserve serve's and smg's."""

from __future__ import annotations

import functools

import helm_sdkpy
import pytest

from shared import config

from .helm_chart import (K8S_VERSIONS, RELEASE, as_the_kubelet_starts_it, install, lint,
                         validate)

FULL = f"{RELEASE}-gapserve"
GATEWAY = {"gateway": {"enabled": True, "dataParallelSize": 3}, "model": "/models/smollm2"}


@functools.cache
def rendered():
    return install(GATEWAY)


def containers() -> dict[str, dict]:
    [(component, _, spec)] = rendered().workloads()
    assert component == "gateway"
    return {c["name"]: c for c in spec["containers"]}


def test_the_gateway_replaces_the_engines_objects_with_one_pod_and_its_service():
    assert rendered().kinds() == sorted([
        ("Deployment", f"{FULL}-gateway"), ("Service", f"{FULL}-gateway"),
        ("Secret", f"{FULL}-internal-token")])
    assert [i for i in lint(GATEWAY) if i["Severity"] > 1] == []
    for obj in rendered().objects:
        for version in K8S_VERSIONS:
            validate(obj, version)


def test_smg_dials_every_served_replicas_scheduler_on_the_pods_loopback():
    from smg.launch_router import parse_router_args

    from gapserve.serve import serve_parser

    engines, smg = containers()["engines"], containers()["smg"]
    args, env = as_the_kubelet_starts_it(engines, {}, pod_index=0)
    assert args[0] == "serve"
    served = config.parse_args(serve_parser(), args[1:], env)
    # nothing of the engines listens beyond the pod, and no token: smg cannot send one
    assert served.host == served.inner_host == "127.0.0.1" and not served.internal_token
    assert (served.data_parallel_size, served.model) == (3, "/models/smollm2")
    gateway_args, _ = as_the_kubelet_starts_it(smg, {}, pod_index=0)
    assert gateway_args[0] == "launch"
    router = parse_router_args(gateway_args[1:])
    assert router.worker_urls == [
        f"grpc://127.0.0.1:{served.scheduler_port + i * served.data_parallel_port_stride}"
        for i in range(3)]
    assert (router.policy, router.port) == ("cache_aware", 30000)
    for c in (engines, smg):
        assert c["resources"]["limits"]["memory"], c["name"]


@pytest.mark.parametrize("values, message", [
    ({"gateway": {"enabled": True}, "router": {"enabled": True}}, "exclude each other"),
    ({"gateway": {"enabled": True}, "tensorParallel": {"size": 2, "multiNode": True}},
     "multiNode is not supported"),
])
def test_gateway_values_it_cannot_honour_are_refused_with_what_to_change(values, message):
    with pytest.raises(helm_sdkpy.InstallError, match=message):
        install(values)
