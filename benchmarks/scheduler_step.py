"""Per-step cost of the scheduler core: one schedule() + update_from_output() with
N running decodes and 10,000 requests waiting (admission is capped by max_num_seqs,
so the waiting queue must cost nothing). Target: under 1 ms at 256 running.

Prints wall-clock and CPU time (this thread only) per step: on a shared machine the
wall clock also counts time the process spent descheduled; CPU time is what the code
costs.

    .venv/bin/python benchmarks/scheduler_step.py [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from scheduler_svc.core import Request, Scheduler, SchedulerConfig
from shared.types import ModelRunnerOutput, SamplingParams

PROMPT_LEN = 128
NUM_WAITING = 10_000


def worker_output(sched: Scheduler, so) -> ModelRunnerOutput:
    """What a worker would answer: one token per request whose step reached its end."""
    ids = list(so.num_scheduled_tokens)
    reqs = sched.requests
    return ModelRunnerOutput(step_id=so.step_id, req_ids=ids, sampled_token_ids=[
        [7] if reqs[i].num_computed_tokens >= reqs[i].num_tokens else [] for i in ids])


def measure(num_running: int, steps: int, num_waiting: int = NUM_WAITING) -> dict[str, float]:
    cfg = SchedulerConfig(max_num_seqs=num_running,
                          max_num_batched_tokens=max(2048, num_running),
                          max_model_len=4096, hash_seed="bench")
    blocks_per_req = (PROMPT_LEN + steps + 64) // cfg.block_size + 1
    sched = Scheduler(cfg, 1 + num_running * blocks_per_req)
    params = SamplingParams(max_tokens=1_000_000, ignore_eos=True)
    for i in range(num_running):
        sched.add_request(Request(f"run-{i}", [i % 50_000 + 3] * PROMPT_LEN, params, [2]))
    while len(sched.running) < num_running or any(r.gap > 1 for r in sched.running):
        so = sched.schedule()
        sched.update_from_output(so, worker_output(sched, so))
    for i in range(num_waiting):
        sched.add_request(Request(f"wait-{i}", [5, i % 1000 + 3] * 64, params, [2]))
    wall, cpu = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        so = sched.schedule()
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        mro = worker_output(sched, so)  # the worker's part: not counted
        w2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        sched.update_from_output(so, mro)
        w3, c3 = time.perf_counter_ns(), time.thread_time_ns()
        assert len(so.num_scheduled_tokens) == num_running
        wall.append((w1 - w0 + w3 - w2) / 1e6)
        cpu.append((c1 - c0 + c3 - c2) / 1e6)
    return {"wall_p50": statistics.median(wall), "wall_min": min(wall),
            "cpu_p50": statistics.median(cpu), "cpu_p90": statistics.quantiles(cpu, n=10)[-1]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    print("ms per step (schedule + update)")
    print(f"{'running':>8} {'waiting':>8} {'cpu p50':>8} {'cpu p90':>8} {'wall p50':>9} {'wall min':>9}")
    for n in (64, 256, 1024):
        m = measure(n, args.steps)
        print(f"{n:>8} {NUM_WAITING:>8} {m['cpu_p50']:>8.3f} {m['cpu_p90']:>8.3f} "
              f"{m['wall_p50']:>9.3f} {m['wall_min']:>9.3f}")


if __name__ == "__main__":
    main()
