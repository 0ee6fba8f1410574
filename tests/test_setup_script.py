"""scripts/setup.sh (issue 44 item 1): serving installs only the project's
`dependencies`, the tests add the test extras, and a start whose environment is
installed and unchanged runs no pip at all (the stamp in .venv).

The script runs for real here against a stub virtualenv whose `python` records its
arguments instead of running pip: what is checked is the script's own decisions."""

import os
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_RUNNERS = ("pytest", "pytest-timeout", "hypothesis", "triton")


@pytest.fixture
def checkout(tmp_path):
    """A copy of what setup.sh reads, with a stub .venv/bin/python that logs its calls."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../calls"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def setup(checkout, *args) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GAPSERVE_VENV"}
    result = subprocess.run(["bash", str(checkout / "scripts" / "setup.sh"), *args],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def pip_calls(checkout) -> list[str]:
    calls = checkout / ".venv" / "calls"
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [line for line in lines if " pip install " in f" {line} "]


def test_the_serving_dependencies_hold_no_test_runner():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split("=")[0].split(";")[0].split("[")[0].strip().lower()
             for d in project["dependencies"]}
    assert not names & set(TEST_RUNNERS)
    assert "pytest==" in " ".join(project["optional-dependencies"]["test"])


def test_a_fresh_serve_install_asks_pip_for_no_test_extras(checkout):
    setup(checkout, "serve")
    calls = pip_calls(checkout)
    assert any("torch==2.13.0" in c for c in calls)
    assert any(c.endswith("-e .") for c in calls)
    assert not any("[test]" in c or "pytest" in c for c in calls)


def test_a_test_install_adds_the_test_extras(checkout):
    setup(checkout, "test")
    assert any(c.endswith("-e .[test]") for c in pip_calls(checkout))


def test_a_test_install_adds_the_no_deps_packages_without_dependencies(checkout):
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["gapserve"][
        "setup"]["test-no-deps"]
    assert pins  # what the sed in setup.sh reads is what TOML reads
    setup(checkout, "test")
    calls = pip_calls(checkout)
    assert any(c.endswith("--no-deps " + " ".join(pins)) for c in calls), calls


def test_a_serve_install_adds_no_no_deps_package(checkout):
    setup(checkout, "serve")
    assert not any("--no-deps" in c for c in pip_calls(checkout))


def test_a_second_start_with_nothing_changed_runs_no_pip(checkout):
    setup(checkout, "serve")
    before = len(pip_calls(checkout))
    assert setup(checkout, "--decide", "serve") == "skip"
    setup(checkout, "serve")
    assert len(pip_calls(checkout)) == before


def test_a_test_install_satisfies_serve_but_not_the_reverse(checkout):
    setup(checkout, "serve")
    assert setup(checkout, "--decide", "test") == "install"
    setup(checkout, "test")
    assert setup(checkout, "--decide", "serve") == "skip"
    assert setup(checkout, "--decide", "test") == "skip"


def test_a_changed_pyproject_installs_again(checkout):
    setup(checkout, "serve")
    with open(checkout / "pyproject.toml", "a") as f:
        f.write("\n# a new pin\n")
    assert setup(checkout, "--decide", "serve") == "install"


def test_an_environment_without_a_stamp_installs(checkout):
    assert setup(checkout, "--decide", "serve") == "install"
