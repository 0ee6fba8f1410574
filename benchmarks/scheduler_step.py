"""Per-step cost of the scheduler core: one schedule() + update_from_output() with
N running decodes and 10,000 requests waiting (admission is capped by max_num_seqs,
so the waiting queue must cost nothing). Target: under 1 ms at 256 running.

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


def measure(num_running: int, steps: int) -> tuple[float, float, float, float]:
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
    for i in range(NUM_WAITING):
        sched.add_request(Request(f"wait-{i}", [5, i % 1000 + 3] * 64, params, [2]))
    sched_ms, update_ms = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        mro = worker_output(sched, so)
        t2 = time.perf_counter()
        sched.update_from_output(so, mro)
        t3 = time.perf_counter()
        assert len(so.num_scheduled_tokens) == num_running
        sched_ms.append((t1 - t0) * 1e3)
        update_ms.append((t3 - t2) * 1e3)
    total = [a + b for a, b in zip(sched_ms, update_ms)]
    # The minimum is what the code costs; the median adds whatever else the machine runs.
    return (statistics.median(sched_ms), statistics.median(update_ms), statistics.median(total),
            min(total))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    print("per step, ms (schedule and update: medians)")
    print(f"{'running':>8} {'waiting':>8} {'schedule':>9} {'update':>7} {'step p50':>9} {'step min':>9}")
    for n in (64, 256, 1024):
        s, u, t, m = measure(n, args.steps)
        print(f"{n:>8} {NUM_WAITING:>8} {s:>9.3f} {u:>7.3f} {t:>9.3f} {m:>9.3f}")


if __name__ == "__main__":
    main()
