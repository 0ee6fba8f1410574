"""docker-compose.yml, deploy/ and the Dockerfile agree with the Compose
specification and with the services they start. No container engine needed."""

from __future__ import annotations

import argparse
import fnmatch
import re

import pytest
import yaml
from compose_spec import ComposeSpecification
from compose_spec import compose_spec as spec_parser

from shared import config
from shared.flag_spec import env_name

from .compose_file import (COMPOSE_PATH, OBSERVABILITY_ENV, ROOT, depends_on,
                           dockerfile_entrypoint, dockerfile_instructions, environment,
                           gapserve_services, healthcheck_argv, load_compose,
                           memory_limit_bytes, prometheus_targets, published_ports,
                           start_order)
from .cli_parsers import subcommand_parsers


def _validate(text: str) -> None:
    """The Compose specification as the compose_spec crate implements it: unknown
    keys, bad durations, ports and conditions are errors; `<<` merges resolved."""
    compose = spec_parser.PyOptions(apply_merge=True).from_yaml(text)
    compose.validate()  # every named network, volume, config and secret is defined
    ComposeSpecification.model_validate(compose.to_dict())


def _flag_env_names(parser: argparse.ArgumentParser) -> set[str]:
    names = set()
    for action in parser._actions:
        flags = [f for f in action.option_strings
                 if f.startswith("--") and not f.startswith("--no-")]
        if flags and action.dest != "help":
            names.add(env_name(flags[0]))
    return names


DOC = load_compose()  # `docker compose up`: no profile
OBSERVED = load_compose(OBSERVABILITY_ENV)  # `--env-file deploy/observability.env`
EVERY = load_compose(all_profiles=True)
GAPSERVE = gapserve_services(DOC)


def test_compose_file_is_valid_against_the_compose_specification():
    _validate(COMPOSE_PATH.read_text())


@pytest.mark.parametrize("breakage", [
    lambda d: d["services"]["worker"].update(depend_on=["jaeger"]),
    lambda d: d["services"]["worker"]["healthcheck"].update(interval="10q"),
    lambda d: d["services"]["frontend"]["depends_on"]["scheduler"].update(
        condition="service_happy"),
])
def test_the_specification_check_rejects_a_broken_file(breakage):
    doc = load_compose()
    breakage(doc)
    with pytest.raises(ValueError):
        _validate(yaml.safe_dump(doc))


ENV_FILES = sorted((ROOT / "deploy").glob("*.env"))


@pytest.mark.parametrize("env_file", [None, *ENV_FILES],
                         ids=["default", *(p.name for p in ENV_FILES)])
def test_every_depends_on_names_an_active_service_and_nothing_depends_on_itself(env_file):
    # a dependency on a service of an inactive profile fails `docker compose up`, so
    # each way of starting the stack (no env file, each deploy/*.env) is checked
    doc = load_compose(env_file)
    for name, svc in doc["services"].items():
        for dep, condition in depends_on(svc).items():
            assert dep in doc["services"] and dep != name, f"{name} depends on {dep!r}"
            if condition == "service_healthy":
                assert "healthcheck" in doc["services"][dep], f"{dep} has no healthcheck"
    start_order(doc)  # raises on a cycle


def test_without_a_profile_only_gapserve_runs_and_nothing_is_pulled_or_traced():
    assert set(DOC["services"]) == set(GAPSERVE) == {"worker", "scheduler", "frontend"}
    for name, svc in GAPSERVE.items():
        assert environment(svc)["GAPSERVE_OTLP_TRACES_ENDPOINT"] == "", name
    stock = {n for n, svc in EVERY["services"].items() if "build" not in svc}
    assert stock and all(EVERY["services"][n].get("profiles") == ["observability"]
                         for n in stock)


def test_the_observability_env_file_turns_on_the_profile_and_tracing():
    assert set(OBSERVED["services"]) == set(GAPSERVE) | {"jaeger", "prometheus"}
    assert "COMPOSE_PROFILES=observability" in OBSERVABILITY_ENV.read_text().splitlines()


def test_no_health_check_needs_a_newer_engine_than_20_10():
    # healthcheck.start_interval needs Docker Engine >= 25 (compose refuses it below)
    for name, svc in EVERY["services"].items():
        assert "start_interval" not in svc.get("healthcheck", {}), name


def test_every_service_has_a_memory_limit_that_fits_what_it_holds():
    limits = {name: memory_limit_bytes(svc) for name, svc in EVERY["services"].items()}
    assert all(limits.values()), limits
    worker = environment(GAPSERVE["worker"])
    # the KV cache plus fp32 SmolLM2 weights (~0.55 GB) and torch itself
    assert limits["worker"] >= int(worker["GAPSERVE_KV_CACHE_MEMORY"]) + (1 << 30)


def test_the_stack_is_worker_scheduler_frontend_and_the_frontend_starts_last_of_them():
    assert set(GAPSERVE) == {"worker", "scheduler", "frontend"}
    assert depends_on(DOC["services"]["scheduler"])["worker"] == "service_healthy"
    frontend = depends_on(DOC["services"]["frontend"])
    assert frontend["scheduler"] == frontend["worker"] == "service_healthy"


@pytest.mark.parametrize("name", sorted(GAPSERVE))
def test_each_command_is_a_gapserve_subcommand_that_accepts_its_flags_and_environment(name):
    svc = GAPSERVE[name]
    assert dockerfile_entrypoint() == ["gapserve"]
    command = svc["command"]
    assert isinstance(command, list) and command, "use the exec form: a list"
    parsers = subcommand_parsers()
    assert command[0] in parsers, f"{command[0]!r} is not a gapserve subcommand"
    # Parses exactly as the service will, with the compose environment as fallbacks;
    # a bad flag or a bad value in a variable exits with a usage error naming it.
    config.parse_args(parsers[command[0]], command[1:], environ=environment(svc))


def _unread_variables(svc: dict) -> set[str]:
    reads = _flag_env_names(subcommand_parsers()[svc["command"][0]])
    # OTEL_* are the standard OpenTelemetry variables, honoured by every service.
    return {k for k in environment(svc) if k not in reads and not k.startswith("OTEL_")}


@pytest.mark.parametrize("name", sorted(GAPSERVE))
def test_every_variable_set_on_a_service_is_one_it_reads(name):
    assert _unread_variables(GAPSERVE[name]) == set()


def test_the_cli_checks_catch_a_misspelt_variable_and_an_unknown_flag():
    svc = load_compose()["services"]["scheduler"]
    svc["environment"]["GAPSERVE_MAX_NUM_SEQ"] = "8"
    assert _unread_variables(svc) == {"GAPSERVE_MAX_NUM_SEQ"}
    with pytest.raises(SystemExit):
        config.parse_args(subcommand_parsers()["scheduler"], ["--max-sequences", "8"],
                          environ=environment(svc))


@pytest.mark.parametrize("name", sorted(GAPSERVE))
def test_healthcheck_probes_the_port_the_service_listens_on(name):
    # the frontend over the HTTP API its users call, the others over gRPC health
    svc = GAPSERVE[name]
    argv = " ".join(healthcheck_argv(svc))
    assert "deploy/healthcheck.py" in argv
    ports = set(re.findall(r"\$\{?(GAPSERVE_[A-Z_]+)\}?", argv))
    port = "GAPSERVE_HTTP_PORT" if svc["command"][0] == "frontend" else "GAPSERVE_PORT"
    assert ports == {port} and port in environment(svc)
    if port == "GAPSERVE_HTTP_PORT":
        assert f"http://127.0.0.1:${{{port}}}/health" in argv


def test_addresses_name_a_service_and_a_port_it_listens_on():
    env = {name: environment(svc) for name, svc in GAPSERVE.items()}
    for address in env["scheduler"]["GAPSERVE_WORKER_ADDRESSES"].split(","):
        host, port = address.strip().split(":")
        assert GAPSERVE[host]["command"][0] == "worker"
        assert env[host]["GAPSERVE_PORT"] == port
    [address] = env["frontend"]["GAPSERVE_SCHEDULER_ADDRESSES"].split(",")  # one replica
    host, port = address.split(":")
    assert GAPSERVE[host]["command"][0] == "scheduler" and env[host]["GAPSERVE_PORT"] == port


def test_with_the_profile_every_service_traces_to_the_otlp_port_of_a_service_in_it():
    for name, svc in gapserve_services(OBSERVED).items():
        endpoint = environment(svc)["GAPSERVE_OTLP_TRACES_ENDPOINT"]
        host, port = re.fullmatch(r"http://([\w.-]+):(\d+)", endpoint).groups()
        assert host in OBSERVED["services"] and port == "4317", f"{name}: {endpoint}"


def test_the_tracing_backend_takes_otlp_from_other_containers():
    command = OBSERVED["services"]["jaeger"]["command"]
    assert "receivers.otlp.protocols.grpc.endpoint=0.0.0.0:4317" in command


def _metrics_target(name: str, svc: dict) -> str:
    env = environment(svc)
    # a frontend's /metrics is on its HTTP port; `serve` (the gateway profile's
    # replicas in one container) is scraped through its frontend
    port = env["GAPSERVE_HTTP_PORT" if svc["command"][0] in ("frontend", "serve")
               else "GAPSERVE_METRICS_PORT"]
    return f"{name}:{port}"


def test_prometheus_scrapes_every_gapserve_service_on_its_metrics_port():
    targets = prometheus_targets()
    # the default stack's services are static targets, nothing else is: without a
    # profile no target is down
    assert {t for t, (_, _, dns) in targets.items() if not dns} == {
        _metrics_target(name, svc) for name, svc in GAPSERVE.items()}
    # every profile's services (tp2's second rank, dp2's and router's replica 1) are
    # scraped by their compose DNS name, each replica's series under its dp_rank
    every = {_metrics_target(name, svc): name for name, svc in gapserve_services(EVERY).items()}
    assert set(every) <= set(targets)
    for target, name in every.items():
        job, rank, _ = targets[target]
        assert job == f"gapserve-{EVERY['services'][name]['command'][0]}", target
        # serve's frontend sums both replicas: its series carry their own replica label
        serve = EVERY["services"][name]["command"][0] == "serve"
        assert rank == (None if serve else "1" if name.endswith("-dp1") else "0"), target
    command = EVERY["services"]["sglang-router"]["command"]
    router = f"sglang-router:{command[command.index('--prometheus-port') + 1]}"
    # smg (gateway profile) runs in the network of the `engines` container
    command = EVERY["services"]["smg"]["command"]
    gateway = f"engines:{command[command.index('--prometheus-port') + 1]}"
    assert EVERY["services"]["smg"]["network_mode"] == "service:engines"
    assert set(targets) == set(every) | {router, gateway}
    mounts = OBSERVED["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def _published(doc: dict) -> set[tuple[str, int]]:
    loopback = {(name, container) for name, svc in doc["services"].items()
                for ip, _, container in published_ports(svc) if ip == "127.0.0.1"}
    every = {(name, container) for name, svc in doc["services"].items()
             for _, _, container in published_ports(svc)}
    assert loopback == every, "a port published beyond loopback"
    return every


def test_only_the_frontends_ports_are_published_and_only_on_loopback():
    frontend = environment(GAPSERVE["frontend"])
    user_facing = {("frontend", int(frontend["GAPSERVE_HTTP_PORT"])),
                   ("frontend", int(frontend["GAPSERVE_GRPC_PORT"]))}
    assert _published(DOC) == user_facing
    # the observability profile adds its two web UIs, nothing of the inner services
    assert _published(OBSERVED) == user_facing | {("jaeger", 16686), ("prometheus", 9090)}


def _dockerignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(path, p.lstrip("/")) or path.startswith(p.lstrip("/") + "/")
               for p in patterns)


def test_dockerfile_copies_only_files_that_exist_and_the_build_context_keeps():
    copies = [rest.split() for word, rest in dockerfile_instructions() if word == "COPY"]
    local = [args for args in copies if not args[0].startswith("--from=")]
    assert local
    for *sources, _ in local:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert not _dockerignored(source), f"COPY {source}: excluded by .dockerignore"


def test_dockerfile_builds_cpu_torch_by_default_with_a_build_argument_for_cuda():
    args = dict(rest.split("=", 1) for word, rest in dockerfile_instructions()
                if word == "ARG" and "=" in rest)
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert args["EXTRAS"] == ""  # the CPU image: no triton
    runs = " ".join(rest for word, rest in dockerfile_instructions() if word == "RUN")
    # torch's dependencies come from PIP_INDEX_URL: an index holding only torch works
    assert '--index-url "${TORCH_INDEX_URL}" --extra-index-url "${PIP_INDEX_URL}"' in runs
    assert "python -m shared.model_files.default_model" in runs  # weights baked in, never fetched at start
    assert "python -m worker_svc.build_kernels" in runs  # baseline ISA + the build CPU's


def test_dockerfile_needs_no_image_but_its_base_to_build():
    # `# syntax=` makes BuildKit pull a frontend image first
    assert not re.search(r"^#\s*syntax\s*=", (ROOT / "Dockerfile").read_text(), re.M)
    bases = [rest.split()[0] for word, rest in dockerfile_instructions() if word == "FROM"]
    stages = {rest.split()[-1] for word, rest in dockerfile_instructions()
              if word == "FROM" and " AS " in rest.upper()}
    assert set(bases) - stages == {"${PYTHON_IMAGE}"}


def test_triton_is_an_extra_the_cpu_install_does_not_bring():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in project["dependencies"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["cuda"])
    # tests/kernels run the Triton kernels under TRITON_INTERPRET=1
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["test"])


def test_the_image_installs_the_runtime_dependencies_only():
    installs = [rest for word, rest in dockerfile_instructions()
                if word == "RUN" and "pip install" in rest]
    assert installs and not any("[test]" in r or "pytest" in r for r in installs)
    assert any('".${EXTRAS:+[$EXTRAS]}"' in r for r in installs)  # empty on CPU


def test_the_healthcheck_script_is_where_the_image_runs_it():
    copies = [rest.split() for word, rest in dockerfile_instructions() if word == "COPY"]
    assert ["deploy/healthcheck.py", "deploy/healthcheck.py"] in copies
    workdirs = [rest for word, rest in dockerfile_instructions() if word == "WORKDIR"]
    assert workdirs[-1] == "/app"  # the relative path in the compose health checks


def test_the_gateway_profile_puts_smg_on_the_loopback_schedulers_of_two_served_replicas():
    from smg.launch_router import parse_router_args

    from gapserve.serve import serve_parser

    gateway = load_compose(ROOT / "deploy" / "gateway.env")
    engines, smg = gateway["services"]["engines"], gateway["services"]["smg"]
    command = engines["command"]
    assert command[0] == "serve"
    args = config.parse_args(serve_parser(), command[1:], environ=environment(engines))
    assert {k for k in environment(engines)
            if k not in _flag_env_names(serve_parser())} == set()  # each one is read
    # serve keeps the schedulers on loopback, and no token is set: only the processes
    # of this container and smg, which shares its network, reach them
    assert args.inner_host == "127.0.0.1" and not args.internal_token
    assert smg["network_mode"] == "service:engines" and "ports" not in smg
    router = parse_router_args(smg["command"][1:])
    assert smg["command"][0] == "launch"
    assert router.worker_urls == [
        f"grpc://127.0.0.1:{args.scheduler_port + i * args.data_parallel_port_stride}"
        for i in range(args.data_parallel_size)] and args.data_parallel_size == 2
    assert router.policy == "cache_aware"
    published = {(name, container) for name, svc in gateway["services"].items()
                 for _, _, container in published_ports(svc)}
    assert ("engines", router.port) in published


def test_the_smg_image_and_the_charts_default_tag_install_the_pinned_smg():
    pinned = re.search(r'"smg==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"smg=={pinned}" in (ROOT / "deploy" / "smg" / "Dockerfile").read_text()
    assert EVERY["services"]["smg"]["image"] == f"gapserve-smg:{pinned}"
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "gapserve" / "values.yaml").read_text())
    assert values["gateway"]["image"]["tag"] == pinned
