"""`pip install .` (issue 44 item 3): the wheel holds every module of the five
packages, the C kernels' sources and the chat templates, and its `gapserve` entry
point runs. Built offline from a copy of the tracked files (no build isolation: the
build backend is the one in this environment), so the checkout stays untouched."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "frontend_svc", "scheduler_svc", "worker_svc", "gapserve")
# what the installed package reads from its own directory at run time
DATA_SUFFIXES = (".c", ".h", ".jinja")


def tracked(*suffixes: str) -> set[str]:
    files = subprocess.run(["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    return {f for f in files if f.endswith(suffixes) and "/tests/" not in f}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    subprocess.run(["tar", "-cf", "-", *files], cwd=ROOT, check=True,
                   stdout=open(src / "tree.tar", "wb"))
    subprocess.run(["tar", "-xf", "tree.tar"], cwd=src, check=True)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "-q",
                    "-w", str(out)], cwd=src, check=True, timeout=600)
    (built,) = out.glob("gapserve-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_every_module_of_the_packages(wheel):
    missing = tracked(".py") - set(wheel.namelist())
    assert not missing, sorted(missing)[:10]


def test_the_wheel_holds_the_c_sources_and_the_chat_templates(wheel):
    data = tracked(*DATA_SUFFIXES)
    assert any(f.startswith("worker_svc/csrc/") for f in data)
    assert any(f.endswith(".jinja") for f in data)
    assert not data - set(wheel.namelist()), sorted(data - set(wheel.namelist()))


def test_the_wheel_declares_the_gapserve_command_and_no_test_runner(wheel):
    names = wheel.namelist()
    entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt")))
    assert b"gapserve = gapserve.cli:main" in entry_points
    metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    always = [line for line in metadata.splitlines()
              if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert any("torch==" in line for line in always)
    assert not any(r in line for line in always for r in ("pytest", "triton", "grpcio-tools"))


def test_gapserve_help_runs_from_the_unpacked_wheel(wheel, tmp_path):
    wheel.extractall(tmp_path)  # the wheel's files alone on the path, not this checkout
    for argv in (["--help"], ["serve", "--help"]):
        result = subprocess.run([sys.executable, "-c", "import sys; from gapserve.cli import "
                                 "main; sys.exit(main(sys.argv[1:]))", *argv],
                                cwd=tmp_path, env={"PYTHONPATH": str(tmp_path),
                                                   "PATH": "/usr/bin:/bin"},
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert "gapserve serve" in result.stdout
