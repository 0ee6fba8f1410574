"""Worker step time under CPU contention: the thread policy before and after
worker_svc/cpu_threads.py, alone, beside CPU burners, and under a cgroup CPU quota.

    python benchmarks/contention.py [--repeats 2] [--burners 2] [--quota 1.0]
                                    [--policies current,new] [--json out.json]

Each run is a fresh process (libgomp reads its wait policy when it loads) timing
decode steps of the default model at batch 1 and 8 (benchmarks/worker_step.py's
Bench). Policies:
  current  the rule before: threads = usable cores, OpenMP's default wait policy
           (idle threads spin ~300,000 iterations before sleeping)
  new      the worker's rule now: cpu_threads.wait_policy_env (a 1,000-iteration
           spin, then sleep) and --cpu-threads 0, so the compute plan sizes threads
           by affinity and quota
  passive  the rule of 2026-12-03: OMP_WAIT_POLICY=PASSIVE (sleep at once) and
           --cpu-threads 0
  t1       one thread, default wait policy (for reference)
  spin     threads = usable cores, GOMP_SPINCOUNT=10000 (a short spin, for reference)
Scenarios, run in turn in every repeat with the policies' order alternating:
  alone    nothing added (on a shared machine that is not quiet: see the load column)
  burners  N busy-loop processes beside the worker (`--burners`)
  quota    the worker alone in a cgroup limited to `--quota` CPUs (v2 cpu.max, else v1
           cpu.cfs_quota_us; needs root; skipped with a note where it cannot be made)
Reported: median step ms of each run, and over the repeats the median and range;
`x alone` is a scenario's median over the same policy's median alone, the slowdown
contention causes. Ratios mean something within one run of this script only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--child" in sys.argv:
    # a run loads torch's OpenMP runtime under exactly the environment its policy
    # chose, before importing worker_svc could apply the worker's own
    import torch  # noqa: E402,F401
from worker_svc import cpu_threads  # noqa: E402

OMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
CGROUP = "gapserve-contention-bench"


def policy_env(policy: str, cores: int) -> tuple[dict[str, str], int]:
    """(the OpenMP variables, --threads) a run of `policy` starts with."""
    if policy == "current":
        return {}, cores
    if policy == "new":
        return cpu_threads.wait_policy_env({}), 0
    if policy == "t1":
        return {}, 1
    if policy == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}, 0
    if policy == "spin":
        return {"GOMP_SPINCOUNT": "10000"}, cores
    raise SystemExit(f"unknown policy {policy!r}")


class Quota:
    """A cgroup limited to `cpus` CPUs that a child joins through its wrapper shell."""

    def __init__(self, cpus: float):
        self.cpus, self.dir, self.procs, self.note = cpus, None, None, ""
        period = 100_000
        v2 = Path("/sys/fs/cgroup")
        v1 = Path("/sys/fs/cgroup/cpu")
        try:
            if (v2 / "cgroup.controllers").is_file():
                if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
                    (v2 / "cgroup.subtree_control").write_text("+cpu")
                self.dir = v2 / CGROUP
                self.dir.mkdir(exist_ok=True)
                (self.dir / "cpu.max").write_text(f"{int(cpus * period)} {period}")
            elif (v1 / "cpu.cfs_quota_us").is_file():
                self.dir = v1 / CGROUP
                self.dir.mkdir(exist_ok=True)
                (self.dir / "cpu.cfs_period_us").write_text(str(period))
                (self.dir / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
            else:
                self.note = "no cgroup cpu controller here"
        except OSError as e:
            self.dir, self.note = None, f"cannot make a cgroup: {e}"
        if self.dir is not None:
            self.procs = self.dir / "cgroup.procs"

    def wrap(self, argv: list[str]) -> list[str]:
        # the shell joins the cgroup, then becomes the child: no moment outside it
        return ["sh", "-c", f'echo $$ > {self.procs} && exec "$@"', "sh", *argv]

    def remove(self) -> None:
        if self.dir is not None:
            try:
                self.dir.rmdir()
            except OSError:
                pass


def start_burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:  # only the processes this script started, by their handles
        p.kill()
    for p in procs:
        p.wait()


def run_child(policy: str, cores: int, args, quota: Quota | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES}
    omp, threads = policy_env(policy, cores)
    env.update(omp)
    argv = [sys.executable, __file__, "--child", "--threads", str(threads),
            "--decode-steps", str(args.decode_steps)]
    if quota is not None:
        argv = quota.wrap(argv)
    load = os.getloadavg()[0]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{policy} run failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(policy=policy, load_before=load, load_after=os.getloadavg()[0])
    return result


def child(args) -> None:
    """One run: decode steps at batch 1 and 8; prints one JSON line."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from worker_step import Bench, _runner  # imports torch: the environment is read now

    runner = _runner(argparse.Namespace(
        model=None, dtype="auto", quantization=None, load_format="auto",
        max_model_len=512, decode_steps=args.decode_steps, threads=args.threads), [8], 0, 1, 0)
    bench = Bench(runner)
    rows = {}
    for batch in (1, 8):
        bench.prefill(batch, 128)
        bench.decode()  # warm-up
        samples = [bench.decode() for _ in range(args.decode_steps)]
        bench.finish_all()
        rows[batch] = {"step_ms": statistics.median(s[1] for s in samples) * 1e3,
                       "cpu_ms": statistics.median(s[2] for s in samples) * 1e3}
    plan = runner.compute_plan
    print(json.dumps({"threads": plan.threads, "cpu_quota": plan.cpu_quota,
                      "wait_policy": cpu_threads.describe_wait_policy(os.environ),
                      "rows": rows}))


def lscpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return ""
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor", "Flags")
    return "\n".join(line for line in out.splitlines() if line.split(":")[0].strip() in keep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--burners", type=int, default=2, help="busy processes beside the worker")
    ap.add_argument("--quota", type=float, default=1.0, help="CPUs of the cgroup scenario")
    ap.add_argument("--policies", default="current,new")
    ap.add_argument("--scenarios", default="alone,burners,quota")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--json", help="also write every run here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    policies = args.policies.split(",")
    scenarios = args.scenarios.split(",")
    cores = cpu_threads.usable_cores()
    print(f"# contention benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{platform.machine()}, {cores} usable cores, quota here: {cpu_threads.cpu_quota()}")
    print(lscpu_flags())
    runs = []
    for rep in range(args.repeats):
        order = policies if rep % 2 == 0 else policies[::-1]
        for scenario in scenarios:
            for policy in order:
                quota, burners = None, []
                if scenario == "quota":
                    quota = Quota(args.quota)
                    if quota.dir is None:
                        print(f"quota scenario skipped: {quota.note}")
                        continue
                if scenario == "burners":
                    burners = start_burners(args.burners)
                try:
                    r = run_child(policy, cores, args, quota)
                finally:
                    stop(burners)
                    if quota is not None:
                        quota.remove()
                r.update(scenario=scenario, repeat=rep)
                runs.append(r)
                print(f"  rep {rep} {scenario:8s} {policy:8s} threads={r['threads']} "
                      f"decode1={r['rows']['1']['step_ms']:.1f} ms "
                      f"decode8={r['rows']['8']['step_ms']:.1f} ms "
                      f"load {r['load_before']:.1f}", flush=True)
                if args.json:  # after every run: a cut-short benchmark keeps what it has
                    Path(args.json).write_text(json.dumps(
                        {"runs": runs, "lscpu": lscpu_flags(), "burners": args.burners,
                         "quota": args.quota}, indent=2))
    table(runs, policies, scenarios, args)


def table(runs, policies, scenarios, args) -> None:
    def median(scenario, policy, batch, key="step_ms"):
        xs = [r["rows"][batch][key] for r in runs
              if r["scenario"] == scenario and r["policy"] == policy]
        return (statistics.median(xs), min(xs), max(xs)) if xs else None

    labels = {"alone": "alone", "burners": f"{args.burners} burners",
              "quota": f"quota {args.quota:g} CPU"}
    print(f"\n{'scenario':14s} {'policy':8s} {'thr':>3s} {'wait policy':30s} "
          f"{'decode 1 ms (range)':>22s} {'x alone':>7s} {'decode 8 ms (range)':>22s} "
          f"{'x alone':>7s} {'load':>5s}")
    for scenario in scenarios:
        for policy in policies:
            mine = [r for r in runs if r["scenario"] == scenario and r["policy"] == policy]
            if not mine:
                continue
            cells = []
            for batch in ("1", "8"):
                m, lo, hi = median(scenario, policy, batch)
                base = median("alone", policy, batch)
                ratio = f"{m / base[0]:6.1f}x" if base else "      -"
                cells.append(f"{m:8.1f} ({lo:6.0f}-{hi:6.0f}) {ratio:>7s}")
            load = statistics.median(r["load_before"] for r in mine)
            print(f"{labels[scenario]:14s} {policy:8s} {mine[0]['threads']:3d} "
                  f"{mine[0]['wait_policy'][:30]:30s} {cells[0]} {cells[1]} {load:5.1f}")


if __name__ == "__main__":
    main()
