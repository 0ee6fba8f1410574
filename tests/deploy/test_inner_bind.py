"""Issue 28 item 5: a scheduler or worker reachable from the network must
authenticate its callers. Bound off loopback without --internal-token or mTLS it
refuses to start (unless --allow-insecure-inner), and docker-compose.yml, which
binds them on 0.0.0.0, requires the token."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gapserve.serve import main as serve_main
from shared.link_security import LinkSecurity, inner_bind_problem

from .compose_file import MissingVariable, environment, gapserve_services, load_compose

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GAPSERVE_")}
    return subprocess.run([sys.executable, "-m", "gapserve", *argv], cwd=ROOT,
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("service", [
    ["scheduler", "--port", "0", "--metrics-port", "0", "--worker-addresses", "127.0.0.1:9"],
    ["worker", "--port", "0", "--metrics-port", "0"],
], ids=["scheduler", "worker"])
def test_an_inner_service_on_a_public_address_without_a_token_refuses_to_start(service):
    done = _run(*service, "--host", "0.0.0.0")
    assert done.returncode == 2, done.stderr
    assert "refusing to listen on '0.0.0.0' without authentication" in done.stderr
    assert "--internal-token" in done.stderr and "--allow-insecure-inner" in done.stderr


def test_a_token_mtls_loopback_or_the_explicit_flag_lets_it_bind():
    plain = LinkSecurity()
    assert inner_bind_problem("0.0.0.0", plain, False) is not None
    assert inner_bind_problem("10.1.2.3", plain, False) is not None
    assert inner_bind_problem("scheduler", plain, False) is not None  # a name may be public
    assert inner_bind_problem("0.0.0.0", LinkSecurity(token="s3cret"), False) is None
    mtls = LinkSecurity(cert=b"c", key=b"k", ca=b"ca")
    assert inner_bind_problem("::", mtls, False) is None
    # TLS without a CA verifies the server only: any client may still call
    assert inner_bind_problem("0.0.0.0", LinkSecurity(cert=b"c", key=b"k"), False) is not None
    assert inner_bind_problem("0.0.0.0", plain, True) is None
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert inner_bind_problem(host, plain, False) is None, host


def test_gapserve_serve_refuses_a_public_inner_host_before_starting_anything(
        tmp_path, capsys):
    model = tmp_path / "model"  # resolve_model takes a directory as it is
    model.mkdir()
    with pytest.raises(SystemExit) as stopped:
        serve_main(["--model", str(model), "--inner-host", "0.0.0.0"])
    assert stopped.value.code == 2
    assert "--inner-host: refusing to listen on '0.0.0.0'" in capsys.readouterr().err


def test_compose_refuses_to_start_without_an_internal_token():
    with pytest.raises(MissingVariable, match="GAPSERVE_INTERNAL_TOKEN"):
        load_compose(shell={})
    with pytest.raises(MissingVariable):
        load_compose(shell={"GAPSERVE_INTERNAL_TOKEN": ""})


def test_every_composed_gapserve_service_gets_the_exported_token():
    doc = load_compose(shell={"GAPSERVE_INTERNAL_TOKEN": "t0ken"}, all_profiles=True)
    for name, svc in gapserve_services(doc).items():
        if name == "engines":  # the gateway profile: smg sends no token, so its replicas'
            # schedulers and workers stay on loopback inside the container (no token)
            env = environment(svc)
            assert "GAPSERVE_INTERNAL_TOKEN" not in env and "GAPSERVE_INNER_HOST" not in env
            continue
        env = environment(svc)
        assert env["GAPSERVE_HOST"] == "0.0.0.0" and env["GAPSERVE_INTERNAL_TOKEN"] == "t0ken", name
