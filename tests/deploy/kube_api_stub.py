"""A recording stand-in for the Kubernetes API server, on loopback, so that Helm's own
install action (helm-sdkpy, the Helm v4 Go library in a wheel) renders the chart and
sends every object to it. helm-sdkpy has no `helm template`: its native library
exports install, upgrade, lint, show and package but no client-only dry run, so the
manifests come from a real install against this stub instead.

It answers what Helm asks on an install: the server version, API discovery (the
built-in kinds the chart uses, plus the LeaderWorkerSet and ServiceMonitor CRDs),
`lookup` and the release history (nothing exists yet: 404 and empty lists), and the
creates and updates, which it stores and echoes back. It checks nothing itself:
no schema, admission, defaulting or controller runs here (kubernetes-validate checks
the recorded objects against the API schemas afterwards; tests/deploy/helm_chart.py).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def server_version(minor: int) -> dict:
    return {"major": "1", "minor": str(minor), "gitVersion": f"v1.{minor}.0",
            "platform": "linux/amd64"}


# group/version -> [(plural, Kind, namespaced)]: what discovery advertises
RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [("secrets", "Secret", True), ("services", "Service", True),
           ("configmaps", "ConfigMap", True), ("pods", "Pod", True),
           ("namespaces", "Namespace", False), ("serviceaccounts", "ServiceAccount", True)],
    "apps/v1": [("deployments", "Deployment", True), ("statefulsets", "StatefulSet", True)],
    "leaderworkerset.x-k8s.io/v1": [("leaderworkersets", "LeaderWorkerSet", True)],
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True)],
}
PLURALS = {plural for kinds in RESOURCES.values() for plural, _, _ in kinds}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def _resource_list(group_version: str) -> dict:
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
            "resources": [{"name": plural, "singularName": kind.lower(), "kind": kind,
                           "namespaced": namespaced, "verbs": VERBS}
                          for plural, kind, namespaced in RESOURCES[group_version]]}


def _group_list() -> dict:
    groups = []
    for gv in RESOURCES:
        if "/" in gv:
            group, version = gv.split("/")
            entry = {"groupVersion": gv, "version": version}
            groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def _not_found(path: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f"{path} not found", "reason": "NotFound", "code": 404}


@dataclass
class KubeApiStub:
    """Every object created through it lands in `created`, in order; `existing`
    ({API path: object}) is what the cluster already holds (`lookup` reads it)."""
    existing: dict[str, dict] = field(default_factory=dict)
    minor: int = 32  # the Kubernetes version it claims to be, 1.<minor>
    created: list[dict] = field(default_factory=list)
    patched: list[dict | None] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: `requests` records them
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict | None:
                """JSON as sent, or None for protobuf (client-go's typed clients,
                here only Helm's release record, a Secret, which the tests skip)."""
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if "json" not in (self.headers.get("Content-Type") or ""):
                    return None
                return json.loads(data) if data else {}

            def _echo(self, code: int, body: dict | None) -> None:
                # a protobuf body is answered with a bare object of its kind, in JSON
                # (client-go decodes by the reply's Content-Type)
                self._send(code, body if body is not None else
                           {"kind": "Secret", "apiVersion": "v1", "metadata": {}})

            def do_GET(self) -> None:
                path = self.path.split("?")[0].rstrip("/")
                stub.requests.append(f"GET {self.path}")
                if path == "/version":
                    return self._send(200, server_version(stub.minor))
                if path == "/api":
                    return self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
                if path == "/apis":
                    return self._send(200, _group_list())
                gv = path.removeprefix("/api/").removeprefix("/apis/")
                if gv in RESOURCES:
                    return self._send(200, _resource_list(gv))
                if path in stub.existing:
                    return self._send(200, stub.existing[path])
                # a collection (the release history): empty; one object: not there
                if path.rsplit("/", 1)[-1] in PLURALS:
                    return self._send(200, {"kind": "List", "apiVersion": "v1",
                                            "metadata": {}, "items": []})
                return self._send(404, _not_found(path))

            def do_POST(self) -> None:
                body = self._body()
                stub.requests.append(f"POST {self.path}")
                if body is not None:
                    stub.created.append(body)
                return self._echo(201, body)

            def do_PUT(self) -> None:  # the release record's status update
                stub.requests.append(f"PUT {self.path}")
                return self._echo(200, self._body())

            def do_PATCH(self) -> None:  # Helm adopting an object it finds: the
                # patch is recorded, and the object answered as it was (not merged)
                stub.requests.append(f"PATCH {self.path}")
                path = self.path.split("?")[0]
                stub.patched.append(self._body())
                return self._echo(200, stub.existing.get(path))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def kubeconfig(self, url: str, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "stub",
            "clusters": [{"name": "stub", "cluster": {"server": url}}],
            "users": [{"name": "stub", "user": {"token": "stub"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}]}))
        return path
