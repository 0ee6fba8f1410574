"""Reading docker-compose.yml and the Dockerfile the way Docker does, for the tests:
variables interpolated and profiles applied from an env file, normalized environment
and depends_on, start order, the image's entry point, health checks as argv, and
moving the stack's container ports onto free loopback ports."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_PATH = ROOT / "docker-compose.yml"
DOCKERFILE_PATH = ROOT / "Dockerfile"
PROMETHEUS_PATH = ROOT / "deploy" / "prometheus.yml"
OBSERVABILITY_ENV = ROOT / "deploy" / "observability.env"

# ${NAME}, ${NAME:-default}, ${NAME-default}; `$$` is compose's escape, left for the
# container's shell (healthcheck_argv turns it into `$`).
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
# What a user exports before `docker compose up` (the file requires it).
SHELL = {"GAPSERVE_INTERNAL_TOKEN": "compose-test-token"}


class MissingVariable(ValueError):
    """`${NAME:?message}` with NAME unset or empty: compose refuses to start."""


TP2_ENV_PATH = ROOT / "deploy" / "tp2.env"
DP2_ENV_PATH = ROOT / "deploy" / "dp2.env"
ROUTER_ENV_PATH = ROOT / "deploy" / "router.env"


def prometheus_targets() -> dict[str, tuple[str, str, bool]]:
    """deploy/prometheus.yml's targets as Prometheus builds them: {host:port: (job,
    dp_rank label, found by DNS)}, each static group's labels and each job's
    `replace` relabelling applied to `__meta_dns_name` (anchored regex, `$1`)."""
    prom = yaml.safe_load(PROMETHEUS_PATH.read_text())
    found = {}
    for job in prom["scrape_configs"]:
        groups = [(t, sc.get("labels", {}), "") for sc in job.get("static_configs", [])
                  for t in sc["targets"]]
        groups += [(f"{n}:{sd['port']}", {}, n) for sd in job.get("dns_sd_configs", [])
                   for n in sd["names"]]
        for target, labels, dns_name in groups:
            labels = dict(labels)
            for rule in job.get("relabel_configs", []):
                assert rule.get("action", "replace") == "replace", rule
                value = ";".join({"__meta_dns_name": dns_name}[s] for s in rule["source_labels"])
                m = re.fullmatch(rule["regex"], value)
                if m:
                    labels[rule["target_label"]] = m.expand(
                        rule.get("replacement", "$1").replace("$1", r"\1"))
            assert target not in found, f"{target} scraped twice"
            found[target] = (job["job_name"], labels.get("dp_rank"), bool(dns_name))
    return found


def read_env_file(path: Path | None) -> dict[str, str]:
    """KEY=VALUE lines as `docker compose --env-file` reads them; None: no variables."""
    if path is None:
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if "=" in line and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def interpolate(value, env: dict[str, str]):
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$$"
        name, op, default = m.groups()
        if name in env and (env[name] or op not in (":-", ":?")):
            return env[name]
        if op in (":?", "?"):
            raise MissingVariable(f"required variable {name} is missing a value: {default}")
        return default if op else ""

    return _VARIABLE.sub(sub, value)


def load_compose(env_file: Path | None = None, *, all_profiles: bool = False,
                 shell: dict[str, str] | None = None) -> dict:
    """The file as `docker compose [--env-file F] config` sees it: anchors and `<<`
    merged, variables from F interpolated over `shell` (what the user exported; SHELL
    by default, never this process's environment, for repeatable tests), and only
    the services of COMPOSE_PROFILES (unless all_profiles)."""
    env = {**(SHELL if shell is None else shell), **read_env_file(env_file)}
    doc = interpolate(yaml.safe_load(COMPOSE_PATH.read_text()), env)
    active = {p for p in env.get("COMPOSE_PROFILES", "").split(",") if p}
    if not all_profiles:
        doc["services"] = {name: svc for name, svc in doc["services"].items()
                           if not svc.get("profiles") or active & set(svc["profiles"])}
    return doc


def gapserve_services(doc: dict) -> dict[str, dict]:
    """The services built from this repository's Dockerfile (the others are stock
    images, or sglang-router's own image built from deploy/sglang-router)."""
    return {name: svc for name, svc in doc["services"].items()
            if (svc.get("build") or {}).get("context") == "."}


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # the "KEY=value" list form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in env.items()}


def depends_on(svc: dict) -> dict[str, str]:
    """{service: condition}; the short list form means service_started."""
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def start_order(doc: dict) -> list[str]:
    """Services with every dependency before its dependents (compose's order)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"depends_on cycle through {name!r}")
        visiting.add(name)
        for dep in depends_on(doc["services"][name]):
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in doc["services"]:
        visit(name)
    return order


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE_PATH.read_text().splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            lines.append((word.upper(), rest.strip()))
        current = ""
    return lines


def dockerfile_entrypoint() -> list[str]:
    entry = [rest for word, rest in dockerfile_instructions() if word == "ENTRYPOINT"]
    return json.loads(entry[-1])  # exec form; the last one counts


def healthcheck_argv(svc: dict) -> list[str]:
    """The health check as the container runs it: CMD-SHELL through /bin/sh -c,
    with compose's `$$` escape already turned into the `$` the shell sees."""
    test = svc["healthcheck"]["test"]
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    if test[0] == "CMD-SHELL":
        return ["/bin/sh", "-c", test[1].replace("$$", "$")]
    if test[0] == "CMD":
        return [arg.replace("$$", "$") for arg in test[1:]]
    raise ValueError(f"unsupported healthcheck test {test!r}")


def duration_s(text: str | int | float | None, default: float) -> float:
    """Compose durations like "1m30s", "500ms", "10s"."""
    if text is None:
        return default
    if isinstance(text, (int, float)):
        return float(text)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"bad duration {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def memory_limit_bytes(svc: dict) -> int | None:
    """deploy.resources.limits.memory ("3g", "512m", "1024k", bytes) in bytes."""
    text = svc.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory")
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)([kmg]?)b?", str(text).lower())
    if m is None:
        raise ValueError(f"bad memory size {text!r}")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]


def published_ports(svc: dict) -> list[tuple[str, int, int]]:
    """(host_ip, host_port, container_port) for the short "ip:host:container" form."""
    out = []
    for spec in svc.get("ports") or []:
        parts = str(spec).split("/")[0].split(":")
        ip = parts[0] if len(parts) == 3 else "0.0.0.0"
        out.append((ip, int(parts[-2]) if len(parts) >= 2 else int(parts[-1]),
                    int(parts[-1])))
    return out


def _free_port() -> int:
    return free_ports(1)[0]


_ADDRESS = re.compile(r"\b([A-Za-z][A-Za-z0-9_.-]*):(\d{1,5})\b")
_BIND_ALL = re.compile(r"tcp://\*:(\d{1,5})\b")  # a ZMQ socket bound in the container


@dataclass(slots=True)
class LoopbackPorts:
    """Each container (service, port) gets its own free port on 127.0.0.1, so a stack
    described for separate containers runs as processes on one machine beside
    anything else already listening."""

    services: set[str]
    ports: dict[tuple[str, int], int] = field(default_factory=dict)

    def port(self, service: str, container_port: int) -> int:
        key = (service, container_port)
        if key not in self.ports:
            self.ports[key] = _free_port()
        return self.ports[key]

    def address(self, service: str, container_port: int) -> str:
        return f"127.0.0.1:{self.port(service, container_port)}"

    def value(self, service: str, key: str, value: str) -> str:
        """An environment value as this service's process must see it locally."""
        if key.endswith("_PORT") and value.isdigit():
            return str(self.port(service, int(value)))
        if value == "0.0.0.0":
            return "127.0.0.1"  # bind only to loopback here

        def move(m: re.Match) -> str:
            host, port = m.group(1), int(m.group(2))
            return self.address(host, port) if host in self.services else m.group(0)

        value = _BIND_ALL.sub(lambda m: f"tcp://{self.address(service, int(m.group(1)))}",
                              value)
        return _ADDRESS.sub(move, value)

    def environment(self, service: str, svc: dict) -> dict[str, str]:
        env = environment(svc)
        moved = {k: self.value(service, k, v) for k, v in env.items()}
        # the tensor-parallel rendezvous names rank 0's container and its port apart
        host = env.get("GAPSERVE_MASTER_ADDR")
        if host in self.services and env.get("GAPSERVE_MASTER_PORT", "").isdigit():
            moved["GAPSERVE_MASTER_ADDR"] = "127.0.0.1"
            moved["GAPSERVE_MASTER_PORT"] = str(self.port(host, int(env["GAPSERVE_MASTER_PORT"])))
        return moved
