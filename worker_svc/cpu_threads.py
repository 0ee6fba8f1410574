"""The worker's CPU thread policy: how many threads compute, and how idle OpenMP
threads wait (docs/worker.md, "Threads under contention"; benchmarks/contention.py).

With OpenMP's default wait policy an idle thread spins ~300,000 iterations on its
core between parallel regions; when another process holds that core, the team's
barrier waits for a thread the kernel has descheduled, and a 2-core worker's step
went from ~30 ms to 0.6-5 s beside other work. PASSIVE waits (sleep at once) cured
that but cost a quiet machine dearly: a lone-stream step is ~150 back-to-back regions
a few tens of microseconds each, and waking a sleeping thread for every one of them
made the default model's step 19 ms with two threads against 8.3 with one and 5 with
a short spin (benchmarks/quant_decode_step.py, docs/benchmarks-contention.md). So
the worker spins briefly: SPIN_COUNT iterations (upward of 13 us on the Xeon of
those figures: a pause there takes 12.7 ns) cover the gap between the regions of one step of the C layer loop, and
a thread still idle after that sleeps, so contention slows a step in proportion to
the CPU taken. (The torch-layer families' regions are further apart, ~70-140 us by a spin-count
sweep: a spin that long is faster quiet but stalls beside other work, docs/benchmarks-contention.md,
"Why not a longer spin".) libgomp reads its variables
once, when it loads (with torch), so `apply_wait_policy` runs when worker_svc is
imported, before torch.

This module imports no torch: it must run before torch is loaded.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

SPIN_COUNT = "1000"  # the worker's default; OMP_WAIT_POLICY or GOMP_SPINCOUNT override
_OPERATOR_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# what apply_wait_policy found and did, for the compute plan's log line
applied_wait_policy = "unset"


def wait_policy_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP variables the worker sets: a short spin before sleeping, unless the
    operator chose a wait policy or spin count themselves (their choice stands)."""
    if any(environ.get(v, "").strip() for v in _OPERATOR_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def describe_wait_policy(environ: Mapping[str, str]) -> str:
    """The wait policy an OpenMP runtime loaded under `environ` follows, in words."""
    policy = environ.get("OMP_WAIT_POLICY", "").strip()
    spin = environ.get("GOMP_SPINCOUNT", "").strip()
    parts = [f"OMP_WAIT_POLICY={policy}" if policy else "default",
             *([f"GOMP_SPINCOUNT={spin}"] if spin else [])]
    return " ".join(parts)


def apply_wait_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """Set the wait policy in this process's environment, before torch loads its
    OpenMP runtime; returns (and keeps for the compute plan's log) what is in effect.
    Once torch is loaded, the runtime has read its variables: nothing changes."""
    global applied_wait_policy
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules:
        applied_wait_policy = describe_wait_policy(environ) + " (torch loaded first)"
        return applied_wait_policy
    chosen = wait_policy_env(environ)
    environ.update(chosen)
    applied_wait_policy = describe_wait_policy(environ) + ("" if chosen else " (operator's)")
    return applied_wait_policy


def thread_count(usable_cores: int, quota_cpus: float | None, ranks_on_host: int) -> int:
    """Threads of one rank when no count is asked for: the cores this process may run
    on (its affinity), capped by its cgroup's CPU quota (a container's --cpus), split
    among the tensor-parallel ranks on this host; at least 1. A quota of 1.5 CPUs
    gives one thread: a second would be throttled for a third of every period."""
    cores = usable_cores
    if quota_cpus is not None:
        cores = min(cores, max(1, math.floor(quota_cpus)))
    return max(1, cores // max(1, ranks_on_host))


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (a cpuset counts)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_quota(proc_cgroup: Path = Path("/proc/self/cgroup"),
              root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs per period this process may use under its cgroup's CFS quota (cgroup v2
    `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), the smallest along its
    cgroup and the ancestors visible here; None where no quota is set or readable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # the v2 unified hierarchy (at root, or root/unified)
            for mount in (root, root / "unified"):
                quotas += _walk(mount, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                quotas += _walk(mount, path, _v1_quota)
    return min(quotas) if quotas else None


def _walk(mount: Path, path: str, read) -> list[float]:
    """Quotas of the cgroup at `path` under `mount` and of its ancestors up to the
    mount. In a container without its own cgroup namespace `path` names the host's
    hierarchy; the mount is then the container's own cgroup, read alone."""
    if not mount.is_dir():
        return []
    here = mount / path.lstrip("/")
    if not here.is_dir():
        here = mount
    out = []
    while True:
        quota = read(here)
        if quota is not None:
            out.append(quota)
        if here == mount or mount not in here.parents:
            return out
        here = here.parent


def _v2_quota(cgroup: Path) -> float | None:
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(cgroup: Path) -> float | None:
    try:
        quota = int((cgroup / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 or period <= 0 else quota / period
