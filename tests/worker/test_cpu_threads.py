"""The CPU thread policy as rules, without timing (worker_svc/cpu_threads.py): a cgroup
CPU quota caps the thread count, idle OpenMP threads spin briefly, then sleep, unless
the operator chose, and the policy is set before torch loads and reported in the compute plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker_svc import cpu_threads
from worker_svc.compute_plan import Kernels, build_plan
from worker_svc.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cores, quota, ranks, threads", [
    (2, None, 1, 2),    # no quota: every usable core
    (2, 1.0, 1, 1),     # docker --cpus 1 on a 2-core host
    (2, 1.5, 1, 1),     # a fractional quota rounds down: a thread never throttled
    (2, 0.5, 1, 1),     # under one CPU: still one thread
    (16, 4.0, 1, 4),
    (16, 8.0, 2, 4),    # the quota's CPUs split among the ranks on this host
    (4, 8.0, 1, 4),     # a quota above the affinity mask: the cores are the cap
    (2, 1.0, 2, 1),     # never below one
])
def test_a_cgroup_cpu_quota_caps_the_threads(cores, quota, ranks, threads):
    assert cpu_threads.thread_count(cores, quota, ranks) == threads


def test_the_compute_plan_follows_the_quota_and_an_explicit_count_wins():
    kernels = Kernels(*[True] * 6)

    def plan(**config):
        return build_plan(WorkerConfig(**config), __import__("torch").device("cpu"),
                          type("Shape", (), {"head_dim": 64, "hidden_size": 576})(),
                          biases=False, kernels=kernels, usable_cores=2, quota_cpus=1.0,
                          environ={})
    assert plan().threads == 1 and plan().cpu_quota == 1.0
    assert "cpu_quota=1" in plan().summary().split()
    assert plan(cpu_threads=2).threads == 2


def _tree(tmp_path: Path, cgroup_lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text(cgroup_lines)
    root = tmp_path / "fs"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


def test_a_cgroup_v2_cpu_max_is_read_as_cpus(tmp_path):
    proc, root = _tree(tmp_path, "0::/box/worker\n",
                       {"box/worker/cpu.max": "150000 100000\n", "box/cpu.max": "max 100000\n"})
    assert cpu_threads.cpu_quota(proc, root) == 1.5


def test_the_smallest_quota_along_the_ancestors_counts(tmp_path):
    proc, root = _tree(tmp_path, "0::/box/worker\n",
                       {"box/worker/cpu.max": "max 100000\n", "box/cpu.max": "50000 100000\n"})
    assert cpu_threads.cpu_quota(proc, root) == 0.5


def test_a_cgroup_v1_cfs_quota_is_read_and_minus_one_means_none(tmp_path):
    files = {"cpu,cpuacct/job/cpu.cfs_quota_us": "200000\n",
             "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
             "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    proc, root = _tree(tmp_path, "4:cpu,cpuacct:/job\n0::/\n", files)
    assert cpu_threads.cpu_quota(proc, root) == 2.0
    proc, root = _tree(tmp_path / "none", "4:cpu,cpuacct:/\n", files)
    assert cpu_threads.cpu_quota(proc, root) is None


def test_a_container_path_not_visible_here_reads_the_mount_itself(tmp_path):
    # v1 without a cgroup namespace: /proc names the host's path, the mount is ours
    proc, root = _tree(tmp_path, "3:cpu:/docker/abc123\n",
                       {"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_threads.cpu_quota(proc, root) == 1.0


def test_no_cgroup_file_means_no_quota(tmp_path):
    assert cpu_threads.cpu_quota(tmp_path / "missing", tmp_path) is None


def test_idle_threads_spin_briefly_then_sleep_unless_the_operator_chose():
    assert cpu_threads.wait_policy_env({}) == {"GOMP_SPINCOUNT": "1000"}
    assert cpu_threads.wait_policy_env({"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert cpu_threads.wait_policy_env({"OMP_WAIT_POLICY": "active"}) == {}
    assert cpu_threads.wait_policy_env({"GOMP_SPINCOUNT": "10000"}) == {}


SCRIPT = """
import json, os, sys
import worker_svc  # sets the wait policy before torch loads
import torch
from worker_svc import cpu_threads
from worker_svc.compute_plan import build_plan
from worker_svc.config import WorkerConfig
shape = type("Shape", (), {"head_dim": 64, "hidden_size": 576})()
plan = build_plan(WorkerConfig(), torch.device("cpu"), shape, biases=False)
print(json.dumps({"env": [os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")],
                  "plan": plan.wait_policy,
                  "fields": plan.log_fields()["wait_policy"]}))
"""


@pytest.mark.parametrize("environ, env, shown", [
    ({}, [None, "1000"], "default GOMP_SPINCOUNT=1000"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", None], "OMP_WAIT_POLICY=ACTIVE (operator's)"),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, ["PASSIVE", None],
     "OMP_WAIT_POLICY=PASSIVE (operator's)"),
])
def test_a_worker_process_sets_the_policy_before_torch_and_its_plan_reports_it(
        environ, env, shown):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",
                                                             "GOMP_SPINCOUNT")}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=300, cwd=REPO,
                            env={**base, "OMP_NUM_THREADS": "1", **environ})
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == {"env": env, "plan": shown, "fields": shown}
