"""The Helm chart (deploy/helm/gapserve): it lints clean, every object it renders is
valid for the Kubernetes API, and the rendered objects keep the rules the services
rely on (tests/deploy/helm_chart.py says how, with no cluster and no Go toolchain)."""

from __future__ import annotations

import base64
import functools
import shutil

import helm_sdkpy
import pytest
import yaml

from .cli_parsers import flag_env_names, subcommand_parsers
from .helm_chart import (CHART, ERROR, K8S_VERSIONS, NAMESPACE, RELEASE, VALUE_SETS,
                         WARNING, as_the_kubelet_starts_it, env_of, install, lint,
                         pod_template, validate)

FULL = f"{RELEASE}-gapserve"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@functools.cache
def rendered(name: str):
    return install(VALUE_SETS[name])


def _container(pod_spec: dict) -> dict:
    assert len(pod_spec["containers"]) == 1
    return pod_spec["containers"][0]


# --- helm lint and the Kubernetes API schemas

@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_chart_lints_without_warnings_or_errors_for_every_value_set(name):
    messages = lint(VALUE_SETS[name])
    bad = [(m["Severity"], m["Path"]) for m in messages if m["Severity"] >= WARNING]
    assert not bad, f"helm lint ({name}): {bad}"


def test_lint_reports_an_error_for_a_broken_template(tmp_path):
    # the lint above can fail: a template that cannot render is an ERROR on templates/
    chart = tmp_path / "gapserve"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "broken.yaml").write_text("kind: {{ .Values.no.such.key }}\n")
    messages = lint({}, chart)
    assert (ERROR, "templates/") in [(m["Severity"], m["Path"]) for m in messages]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_is_valid_for_the_kubernetes_api(name, version):
    for obj in rendered(name).objects:
        validate(obj, version)  # raises with the field path that is wrong


def test_the_schema_check_rejects_an_unknown_field():
    deployment = yaml.safe_load(yaml.safe_dump(rendered("defaults").get("Deployment",
                                                                      "-frontend")))
    _container(deployment["spec"]["template"]["spec"])["livenessProbes"] = {}
    with pytest.raises(Exception, match="livenessProbes"):
        validate(deployment, K8S_VERSIONS[0])


def test_what_helm_sends_to_the_api_server_is_what_it_rendered():
    r = rendered("tp2")
    sent = sorted((o["kind"], o["metadata"]["name"]) for o in r.sent)
    assert sent == r.kinds()


@pytest.mark.parametrize("name", ["multinode-lws", "observability"])
def test_the_crds_are_rendered_only_on_request_and_checked_structurally(name):
    kinds = {k for k, _ in rendered(name).kinds()}
    assert {"LeaderWorkerSet", "ServiceMonitor"} & kinds
    assert not {"LeaderWorkerSet", "ServiceMonitor"} & {k for k, _ in rendered("defaults").kinds()}
    lws = yaml.safe_load(yaml.safe_dump(rendered("multinode-lws").get("LeaderWorkerSet")))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    with pytest.raises(Exception, match="Sometimes"):
        validate(lws, K8S_VERSIONS[0])


# --- what a `helm install` gives

def test_defaults_give_frontends_one_scheduler_and_a_one_rank_worker_with_services():
    r = rendered("defaults")
    assert r.kinds() == sorted([
        ("Deployment", f"{FULL}-frontend"), ("Service", f"{FULL}-frontend"),
        ("Deployment", f"{FULL}-scheduler"), ("Service", f"{FULL}-scheduler"),
        ("StatefulSet", f"{FULL}-worker"), ("Service", f"{FULL}-workers"),
        ("Secret", f"{FULL}-internal-token")])
    assert r.get("Deployment", "-frontend")["spec"]["replicas"] == 2
    assert r.get("Deployment", "-scheduler")["spec"]["replicas"] == 1
    assert r.get("StatefulSet")["spec"]["replicas"] == 1
    for component, spec in r.pod_specs().items():
        assert _container(spec)["args"][0] == component


def test_the_chart_refuses_a_cluster_older_than_1_28():
    # grpc probes and the StatefulSet pod-index label (the worker's rank) need it
    with pytest.raises(helm_sdkpy.InstallError, match="kubeVersion"):
        install({}, minor=27)
    install({}, minor=28)


def test_frontend_replicas_follow_the_values():
    assert install({"frontend": {"replicas": 5}}).get(
        "Deployment", "-frontend")["spec"]["replicas"] == 5


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_env_variable_is_a_flag_of_that_service(name):
    # a misspelt GAPSERVE_* variable is silently ignored by the service
    parsers = subcommand_parsers()
    for component, spec in rendered(name).pod_specs().items():
        known = flag_env_names(parsers[component])
        names = {n for n in env_of(_container(spec)) if n.startswith("GAPSERVE_")}
        assert names <= known, f"{component}: {sorted(names - known)}"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_inner_services_bind_a_pod_address_only_with_the_internal_token_from_a_secret(name):
    r = rendered(name)
    token_secret = VALUE_SETS[name].get("internalToken", {}).get(
        "existingSecret", f"{FULL}-internal-token")
    for component, spec in r.pod_specs().items():
        env = env_of(_container(spec))
        if env.get("GAPSERVE_HOST", {}).get("value", "127.0.0.1") in LOOPBACK:
            continue
        token = env["GAPSERVE_INTERNAL_TOKEN"]
        assert "value" not in token, component
        assert token["valueFrom"]["secretKeyRef"] == {"name": token_secret, "key": "token"}
    for component in ("scheduler", "worker"):
        assert env_of(_container(r.pod_specs()[component]))["GAPSERVE_HOST"]["value"] == "0.0.0.0"


def test_the_generated_internal_token_is_random_and_a_live_one_is_kept():
    secret = rendered("defaults").get("Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    assert token != base64.b64decode(install({}).get("Secret")["data"]["token"]).decode()
    # helm uninstall leaves it; a release of that name adopts it again
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # a cluster that holds the release's token Secret: `lookup` reads it back
    name = f"{FULL}-internal-token"
    live = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "labels": {"app.kubernetes.io/managed-by": "Helm"},
                         "annotations": {"meta.helm.sh/release-name": RELEASE,
                                         "meta.helm.sh/release-namespace": NAMESPACE}},
            "data": {"token": base64.b64encode(b"the-live-token").decode()}}
    again = install({}, existing={f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}": live})
    assert base64.b64decode(again.get("Secret")["data"]["token"]) == b"the-live-token"


def test_an_existing_token_secret_replaces_the_generated_one():
    assert "Secret" not in {k for k, _ in rendered("api-keys-existing-token").kinds()}


def test_frontend_probes_startup_and_liveness_on_health_and_readiness_on_ready():
    c = _container(rendered("defaults").pod_specs()["frontend"])
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert (c["startupProbe"]["periodSeconds"], c["startupProbe"]["failureThreshold"]) == (10, 60)
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_with_api_keys_the_frontend_is_ready_by_its_grpc_health_which_needs_no_key():
    c = _container(rendered("api-keys-existing-token").pod_specs()["frontend"])
    assert c["readinessProbe"]["grpc"] == {"port": 50051}
    assert env_of(c)["GAPSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "gapserve-keys"


def test_scheduler_and_workers_are_probed_by_grpc_health_and_by_tcp_under_tls():
    plain, tls = rendered("defaults").pod_specs(), rendered("tls").pod_specs()
    sched = _container(plain["scheduler"])
    # NOT_SERVING while it holds no worker: readiness yes, liveness no
    assert sched["readinessProbe"]["grpc"] == {"port": 50052}
    assert "tcpSocket" in sched["livenessProbe"]
    worker = _container(plain["worker"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert worker[probe]["grpc"] == {"port": 50053}
        assert "grpc" not in _container(tls["worker"])[probe]  # kubelet's grpc is plaintext
        assert "tcpSocket" in _container(tls["worker"])[probe]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_container_has_a_memory_limit_and_the_pinned_hash_seed(name):
    for component, spec in rendered(name).pod_specs().items():
        c = _container(spec)
        assert c["resources"]["limits"]["memory"], component
        assert env_of(c)["PYTHONHASHSEED"]["value"] == "0", component


def test_tp2_runs_one_pod_per_rank_and_the_scheduler_dials_each_rank():
    r = rendered("tp2")
    sts = r.get("StatefulSet")
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # rank 0 waits for rank 1
    assert r.get("Service", "-workers")["spec"]["publishNotReadyAddresses"] is True
    env = env_of(_container(r.pod_specs()["worker"]))
    assert env["GAPSERVE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["GAPSERVE_TENSOR_PARALLEL_SIZE"]["value"] == "2"
    host = f"{FULL}-workers.{NAMESPACE}.svc"
    assert env["GAPSERVE_MASTER_ADDR"]["value"] == f"{FULL}-worker-0.{host}"
    addresses = env_of(_container(r.pod_specs()["scheduler"]))["GAPSERVE_WORKER_ADDRESSES"]
    assert addresses["value"] == f"{FULL}-worker-0.{host}:50053,{FULL}-worker-1.{host}:50053"


def test_multinode_uses_a_leaderworkerset_with_rank_and_rendezvous_from_lws():
    r = rendered("multinode-lws")
    assert "StatefulSet" not in {k for k, _ in r.kinds()}
    lws = r.get("LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    c = _container(pod_template(lws)["spec"])
    assert c["args"][:5] == ["worker", "--rank", "$(LWS_WORKER_INDEX)",
                             "--master-addr", "$(LWS_LEADER_ADDRESS)"]
    assert "GAPSERVE_RANK" not in env_of(c) and "GAPSERVE_MASTER_ADDR" not in env_of(c)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    # leader <lws>-0, worker <lws>-0-1, under the headless Service LWS names after itself
    host = f"{FULL}-worker.{NAMESPACE}.svc"
    addresses = env_of(_container(r.pod_specs()["scheduler"]))["GAPSERVE_WORKER_ADDRESSES"]
    assert addresses["value"] == f"{FULL}-worker-0.{host}:50053,{FULL}-worker-0-1.{host}:50053"


def test_tls_material_is_mounted_from_its_secret_in_every_service():
    for component, spec in rendered("tls").pod_specs().items():
        c = _container(spec)
        env = env_of(c)
        assert {env[k]["value"] for k in ("GAPSERVE_TLS_CERT", "GAPSERVE_TLS_KEY",
                                          "GAPSERVE_TLS_CA")} == \
            {"/etc/gapserve/tls/tls.crt", "/etc/gapserve/tls/tls.key", "/etc/gapserve/tls/ca.crt"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "gapserve-tls", component
        assert {"name": "tls", "mountPath": "/etc/gapserve/tls", "readOnly": True} in \
            c["volumeMounts"]
    for component, spec in rendered("defaults").pod_specs().items():
        assert "GAPSERVE_TLS_CERT" not in env_of(_container(spec)), component


def test_the_observability_profile_traces_every_service_and_is_scraped():
    r = rendered("observability")
    for component, spec in r.pod_specs().items():
        env = env_of(_container(spec))
        assert env["GAPSERVE_OTLP_TRACES_ENDPOINT"]["value"] == \
            "http://otel-collector.monitoring:4317", component
    for o in r.objects:
        template = pod_template(o)
        if template is not None:
            annotations = template["metadata"]["annotations"]
            port = annotations["prometheus.io/port"]
            assert annotations["prometheus.io/scrape"] == "true"
            assert int(port) in [p["containerPort"] for p in _container(template["spec"])["ports"]]
    # each ServiceMonitor endpoint names a port that the Services have
    ports = {p["name"] for o in r.objects if o["kind"] == "Service" for p in o["spec"]["ports"]}
    endpoints = r.get("ServiceMonitor")["spec"]["endpoints"]
    assert {e["port"] for e in endpoints} <= ports
    assert "GAPSERVE_OTLP_TRACES_ENDPOINT" not in env_of(
        _container(rendered("defaults").pod_specs()["frontend"]))


@pytest.mark.parametrize("values, message", [
    ({"tensorParallel": {"size": 1, "multiNode": True}}, "set tensorParallel.size to 2"),
    ({"tls": {"enabled": True}}, "tls.enabled needs tls.secretName"),
    ({"tensorParallel": {"size": 0}}, "size"),
    ({"frontend": {"httpPort": "eighty"}}, "httpPort"),
])
def test_bad_values_are_refused_with_what_to_change(values, message):
    with pytest.raises(helm_sdkpy.InstallError, match=message):
        install(values)


@pytest.mark.parametrize("name", [n for n in VALUE_SETS if not n.startswith("dp")])
def test_every_pod_starts_with_a_command_line_its_service_accepts(name):
    # (the data-parallel value sets: tests/deploy/test_helm_data_parallel.py)
    # the services' own parsers read the rendered args and GAPSERVE_* variables
    from shared import config
    tp = VALUE_SETS[name].get("tensorParallel", {}).get("size", 1)
    leader = f"{FULL}-worker-0.{FULL}-worker.{NAMESPACE}"
    lws_env = {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": leader, "LWS_GROUP_SIZE": str(tp)}
    parsed = {}
    for component, spec in rendered(name).pod_specs().items():
        args, env = as_the_kubelet_starts_it(_container(spec), lws_env, pod_index=1)
        parsed[component] = config.parse_args(getattr(config, f"{component}_parser")(),
                                               args[1:], env)
    for args in parsed.values():
        assert args.internal_token == "s3cret" and args.host == "0.0.0.0"
    worker = parsed["worker"]
    assert (worker.tensor_parallel_size, worker.port) == (tp, 50053)
    if tp > 1:
        assert worker.rank == 1
        assert worker.master_addr.startswith(f"{FULL}-worker-0.")
    assert len(parsed["scheduler"].worker_addresses) == tp
    assert parsed["frontend"].scheduler_address == f"{FULL}-scheduler.{NAMESPACE}.svc:50052"
    model = VALUE_SETS[name].get("model")
    assert parsed["worker"].model == parsed["frontend"].model == (model or None)
    max_len = VALUE_SETS[name].get("limits", {}).get("maxModelLen")
    assert parsed["worker"].max_model_len == parsed["scheduler"].max_model_len == max_len
