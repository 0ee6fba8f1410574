"""scripts/compose-smoke.sh skips (exit 0, saying so) only where no container engine or
no Compose v2 answers; it never starts anything then. `docker` here is a stand-in
on PATH that answers like a machine without an engine (or without the compose plugin)."""

from __future__ import annotations

import os
import subprocess

import pytest

from .compose_file import ROOT

SCRIPT = ROOT / "scripts" / "compose-smoke.sh"


def _run(tmp_path, docker_body: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho \"$@\" >> \"$0.calls\"\n" + docker_body)
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.parametrize("docker_body, says", [
    ("exit 1\n", "no container engine"),
    ('[ "$1" = info ] && exit 0\nexit 1\n', "no Docker Compose v2"),
])
def test_it_skips_with_exit_0_and_says_why_only_without_engine_or_compose(tmp_path,
                                                                        docker_body, says):
    result = _run(tmp_path, docker_body)
    assert result.returncode == 0, result.stderr
    assert "SKIPPED" in result.stdout and says in result.stdout
    calls = (tmp_path / "docker.calls").read_text().split("\n")
    assert not any(c.startswith(("build", "compose -p")) for c in calls)  # nothing started


def test_with_an_engine_a_failing_step_fails_the_script(tmp_path):
    # engine and compose answer, but the first real step (the build) fails
    body = '[ "$1" = build ] && exit 3\nexit 0\n'
    result = _run(tmp_path, body)
    assert result.returncode != 0
    assert "FAILED" in result.stdout and "SKIPPED" not in result.stdout


IMAGE_SCRIPT = ROOT / "scripts" / "image-smoke.sh"


def _run_image(tmp_path, docker_body: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho \"$@\" >> \"$0.calls\"\n" + docker_body)
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    return subprocess.run(["bash", str(IMAGE_SCRIPT), "gapserve:test"], capture_output=True,
                          text=True, env=env, timeout=60)


def test_the_image_smoke_skips_with_exit_0_only_without_an_engine(tmp_path):
    result = _run_image(tmp_path, "exit 1\n")
    assert result.returncode == 0, result.stderr
    assert "SKIPPED" in result.stdout and "no container engine" in result.stdout
    calls = (tmp_path / "docker.calls").read_text().split("\n")
    assert not any(c.startswith(("run", "exec")) for c in calls)  # nothing started


def test_the_image_smoke_fails_without_the_image_and_when_the_check_fails(tmp_path):
    missing = _run_image(tmp_path, '[ "$1" = info ] && exit 0\nexit 1\n')
    assert missing.returncode == 1 and "no image gapserve:test" in missing.stdout
    # engine and image answer, the check inside the container fails: FAILED, removed
    failing = _run_image(tmp_path, '[ "$1" = exec ] && exit 1\n'
                                   '[ "$1" = image ] && echo 1000000000\nexit 0\n')
    assert failing.returncode != 0
    assert "FAILED" in failing.stdout and "SKIPPED" not in failing.stdout
    calls = (tmp_path / "docker.calls").read_text().split("\n")
    assert any(c.startswith("rm -f gapserve-image-smoke-") for c in calls)
