"""Lone-stream decode step time of the default model on the GGUF quantized path
(default) and the exact path (--dtype float32): two ModelRunners in one process,
alternating --rounds rounds of 48 greedy decode steps after a short prompt; prints
the best and median step time per path.

    python benchmarks/quant_decode_step.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.worker.step_driver

from shared.model_files.default_model import resolve_model  # noqa: E402
from tests.worker.step_driver import StepDriver  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

PATHS = {"quantized (default)": "auto", "exact (--dtype float32)": "float32"}
PROMPT = [1, 504, 3575, 282, 4649, 314]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = resolve_model(None)
    runners = {name: ModelRunner(WorkerConfig(model=str(model), device="cpu", dtype=dtype,
                                              max_model_len=512, num_gpu_blocks_override=64,
                                              max_num_seqs=4))
               for name, dtype in PATHS.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_ in range(args.rounds):
        for name, runner in runners.items():
            rid = f"r{round_}"
            driver = StepDriver(runner)
            driver.add(rid, PROMPT, max_new=49)
            driver.step()  # the prefill and the first token, untimed
            while not driver.requests[rid].done:
                start = time.perf_counter()
                driver.step()
                times[name].append(time.perf_counter() - start)
    print(f"# load average {os.getloadavg()[0]:.1f}")
    print(f"{'path':26} {'best ms':>8} {'median ms':>9} {'steps':>6}")
    for name, ts in times.items():
        print(f"{name:26} {min(ts) * 1e3:8.1f} {statistics.median(ts) * 1e3:9.1f} {len(ts):6d}")


if __name__ == "__main__":
    main()
