"""The Helm chart (deploy/helm/gapserve) as CI checks it, without a cluster or a Go
toolchain: helm-sdkpy (the Helm v4 library in a wheel) lints it and installs it into
a recording stand-in for the API server (tests/deploy/kube_api_stub.py), which is how
the manifests are rendered (the library has no `helm template`); kubernetes-validate
checks every rendered object against the Kubernetes API's JSON schemas. The two
CRDs the chart may render have no schema there: LeaderWorkerSet and ServiceMonitor
are checked against the structural schemas below, and the LeaderWorkerSet's pod
template against the core PodTemplate schema."""

from __future__ import annotations

import asyncio
import copy
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import helm_sdkpy
import jsonschema
import kubernetes_validate
import yaml

from .compose_file import ROOT
from .kube_api_stub import KubeApiStub

CHART = ROOT / "deploy" / "helm" / "gapserve"
# the chart's floor (Chart.yaml kubeVersion) and the newest schemas the package has
K8S_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
RELEASE = "r1"
NAMESPACE = "serving"
# helm.sh/helm/v4/pkg/chart/v2/lint/support: Severity
INFO, WARNING, ERROR = 1, 2, 3

# Each way the chart is meant to be installed; every check runs on each.
VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "tp2": {"tensorParallel": {"size": 2}, "model": "/models/smollm2",
            "limits": {"maxModelLen": 2048, "maxNumSeqs": 64}},
    "multinode-lws": {"tensorParallel": {"size": 2, "multiNode": True},
                      "worker": {"gpusPerRank": 1}},
    "tls": {"tls": {"enabled": True, "secretName": "gapserve-tls"}},
    "observability": {"observability": {
        "otlpTracesEndpoint": "http://otel-collector.monitoring:4317",
        "serviceMonitor": {"enabled": True}}},
    "api-keys-existing-token": {"frontend": {"apiKeys": {"existingSecret": "gapserve-keys"}},
                                "internalToken": {"existingSecret": "gapserve-token"}},
    # data parallelism: two engines behind the frontends' kv-aware routing, and behind
    # sglang-router (a frontend each); the second with tensor parallelism as well
    "dp2": {"dataParallelSize": 2},
    "dp2-router-tp2": {"dataParallelSize": 2, "router": {"enabled": True},
                       "tensorParallel": {"size": 2}},
}


def merged(overrides: dict, base: dict | None = None) -> dict:
    """The chart's values.yaml with overrides laid over it, maps merged key by key
    (Helm's coalescing for the value sets above, which set no nulls)."""
    out = copy.deepcopy(base if base is not None else
                        yaml.safe_load((CHART / "values.yaml").read_text()))
    for key, value in overrides.items():
        out[key] = merged(value, out[key]) if isinstance(value, dict) and \
            isinstance(out.get(key), dict) else copy.deepcopy(value)
    return out


def _config(kubeconfig: str | None = None) -> helm_sdkpy.Configuration:
    return helm_sdkpy.Configuration(namespace=NAMESPACE, kubeconfig=kubeconfig)


def lint(overrides: dict, chart: Path = CHART) -> list[dict]:
    """`helm lint` with these values: the library's lint takes no values, so it lints
    a copy of the chart whose values.yaml holds the merged values. Returns Helm's
    messages; their error text is lost on the way (a Go error marshals to {}), only
    severity and path come back."""
    with tempfile.TemporaryDirectory() as tmp:
        copy_ = Path(tmp) / chart.name
        shutil.copytree(chart, copy_)
        (copy_ / "values.yaml").write_text(yaml.safe_dump(merged(overrides)))
        result = asyncio.run(helm_sdkpy.Lint(_config()).run(str(copy_)))
    return result.get("Messages") or []


class Rendered:
    """One install of the chart: the manifest Helm rendered and what it sent."""

    def __init__(self, release: dict, created: list[dict]) -> None:
        self.notes = release["info"].get("notes", "")
        self.objects = [doc for doc in yaml.safe_load_all(release["manifest"]) if doc]
        self.sent = created

    def get(self, kind: str, name_suffix: str = "") -> dict:
        found = [o for o in self.objects
                 if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"{len(found)} {kind} named *{name_suffix}"
        return found[0]

    def kinds(self) -> list[tuple[str, str]]:
        return sorted((o["kind"], o["metadata"]["name"]) for o in self.objects)

    def pod_specs(self) -> dict[str, dict]:
        """{component: pod spec} of every gapserve workload (with several data-parallel
        replicas, one of each component: workloads() has them all; sglang-router's
        pod is not a gapserve service)."""
        return {component: spec for component, _, spec in self.workloads()
                if component != "router"}

    def workloads(self) -> list[tuple[str, str, dict]]:
        """(component, object name, pod spec) of every workload, in render order."""
        out = []
        for o in self.objects:
            template = pod_template(o)
            if template is not None:
                out.append((o["metadata"]["labels"]["app.kubernetes.io/component"],
                            o["metadata"]["name"], template["spec"]))
        return out


def pod_template(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return obj["spec"]["template"]
    if obj["kind"] == "LeaderWorkerSet":
        return obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return None


# client-go caches API discovery under ~/.kube/cache, per server address: each stub
# has a new port, so what an install adds there is removed after it (KUBECACHEDIR
# cannot move it: the Go runtime reads the environment the process started with).
KUBE_CACHE = Path.home() / ".kube" / "cache"


@contextmanager
def _no_new_kube_cache():
    def entries() -> set[Path]:
        return {p for sub in ("discovery", "http") if (KUBE_CACHE / sub).is_dir()
                for p in (KUBE_CACHE / sub).iterdir()}
    home_had_kube = KUBE_CACHE.parent.exists()
    before = entries()
    try:
        yield
    finally:
        for path in entries() - before:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if not home_had_kube:
            shutil.rmtree(KUBE_CACHE.parent, ignore_errors=True)


def install(overrides: dict, existing: dict[str, dict] | None = None,
            minor: int = 32) -> Rendered:
    """`helm install` (no wait) into the recording API stub, a Kubernetes 1.<minor>
    that already holds `existing` ({API path: object}); raises
    helm_sdkpy.InstallError with Helm's message when the chart refuses."""
    stub = KubeApiStub(existing=existing or {}, minor=minor)
    url = stub.start()
    try:
        with tempfile.TemporaryDirectory() as tmp, _no_new_kube_cache():
            kubeconfig = stub.kubeconfig(url, Path(tmp) / "kubeconfig")
            release = asyncio.run(helm_sdkpy.Install(_config(str(kubeconfig))).run(
                RELEASE, str(CHART), values=overrides or None, wait=False, timeout=60))
    finally:
        stub.stop()
    return Rendered(release, stub.created)


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# --- the CRDs: structural schemas of the fields of their v1 APIs this chart may
# set (leaderworkerset.x-k8s.io/v1 LeaderWorkerSet; monitoring.coreos.com/v1
# ServiceMonitor). Unknown fields are errors; the pod template is checked apart.
_META = {"type": "object", "required": ["name"],
         "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                 "maxLength": 63},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "annotations": {"type": "object",
                                        "additionalProperties": {"type": "string"}}}}
LWS_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": _META,
        "spec": {
            "type": "object", "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {"type": "object"},
                "networkConfig": {"type": "object"},
                "leaderWorkerTemplate": {
                    "type": "object", "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart",
                                                   "RecreateGroupAfterStart", "None"]},
                        "leaderTemplate": {"type": "object"},
                        "workerTemplate": {"type": "object"},
                        "subGroupPolicy": {"type": "object"}}}}}}}
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _META,
        "spec": {
            "type": "object", "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object",
                                    "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "targetPort": {},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string",
                                     "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
                                                "(([0-9]+)ms)?)$"},
                        "scrapeTimeout": {"type": "string"},
                        "honorLabels": {"type": "boolean"},
                        "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"},
                        "tlsConfig": {"type": "object"}}}}}}}}
CRD_SCHEMAS = {"LeaderWorkerSet": LWS_SCHEMA, "ServiceMonitor": SERVICE_MONITOR_SCHEMA}


def validate(obj: dict, version: str) -> None:
    """Raises when obj is not valid for that Kubernetes version (strict: unknown
    fields fail too)."""
    schema = CRD_SCHEMAS.get(obj["kind"])
    if schema is None:
        kubernetes_validate.validate(obj, version, strict=True)
        return
    jsonschema.Draft7Validator(schema).validate(obj)
    if obj["kind"] == "LeaderWorkerSet":  # its pod templates are core PodTemplateSpecs
        for key in ("workerTemplate", "leaderTemplate"):
            spec = obj["spec"]["leaderWorkerTemplate"].get(key)
            if spec is not None:
                kubernetes_validate.validate(
                    {"apiVersion": "v1", "kind": "PodTemplate",
                     "metadata": {"name": obj["metadata"]["name"]}, "template": spec},
                    version, strict=True)


def as_the_kubelet_starts_it(container: dict, injected: dict[str, str], pod_index: int,
                             secret: str = "s3cret") -> tuple[list[str], dict[str, str]]:
    """(args, environment) of a container as the kubelet starts it: Secret
    references read as `secret`, the pod-index label as pod_index, `injected` (what
    LWS adds) beneath, and $(VAR) in args expanded from that environment (an
    unknown one stays as written, as the kubelet leaves it)."""
    env = dict(injected)
    for name, e in env_of(container).items():
        source = e.get("valueFrom", {})
        if "value" in e:
            env[name] = e["value"]
        elif "secretKeyRef" in source:
            env[name] = secret
        else:
            assert source["fieldRef"]["fieldPath"] == \
                "metadata.labels['apps.kubernetes.io/pod-index']", source
            env[name] = str(pod_index)
    args = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a)
            for a in container["args"]]
    return args, env
