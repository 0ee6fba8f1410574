"""Lone-stream decode step time of the default model (or --gguf FILE) on the GGUF
quantized path (default), the quantized path with int8 activations
(--quant-activations int8) and the exact path (--dtype float32): ModelRunners in one process,
alternating --rounds rounds of 48 greedy decode steps after a short prompt; prints
the best and median step time per path, and the median of each part of a step: input
preparation, the embedding lookup, the decoder layers (one C call), the final norm
and vocabulary projection, sampling (the rest: the runner's bookkeeping).

    python benchmarks/quant_decode_step.py [--rounds 3] [--paths quantized,int8,exact]
                                           [--gguf FILE]
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

import torch  # noqa: E402  (after worker_svc: its OpenMP wait policy is set before torch loads)

# the default path; --quant-activations int8; --dtype float32
PATHS = {"quantized": ("auto", "float32"), "int8": ("auto", "int8"),
         "exact": ("float32", "float32")}
# the runner's and model's methods timed as a step's parts (their wall time per call)
PARTS = (("prepare", "runner", "_prepare_inputs"), ("embed", "model", "_embed"),
         ("layers", "layers", "run"), ("logits", "model", "_logits"),
         ("sample", "runner", "_sample"))


def time_parts(runner: ModelRunner) -> dict[str, list[float]]:
    """Wraps each part's method on this runner's objects; returns the lists its calls'
    seconds go into."""
    owners = {"runner": runner, "model": runner.model,
              "layers": getattr(runner.model, "decode_layers", None)}
    spent: dict[str, list[float]] = {}
    for part, owner_name, method in PARTS:
        owner = owners[owner_name]
        if owner is None or not hasattr(owner, method):  # e.g. Gemma 3's own model class
            continue
        spent[part] = []

        def timed(*a, _fn=getattr(owner, method), _into=spent[part], **k):
            start = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _into.append(time.perf_counter() - start)
        setattr(owner, method, timed)
    return spent
PROMPT = [1, 504, 3575, 282, 4649, 314]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list of " + ", ".join(PATHS))
    ap.add_argument("--gguf", default=None, help="a GGUF (default: the default model's)")
    args = ap.parse_args()
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    if not names or any(n not in PATHS for n in names):
        ap.error(f"--paths takes {', '.join(PATHS)}")
    model = resolve_model(args.gguf)
    runners = {name: ModelRunner(WorkerConfig(model=str(model), device="cpu",
                                              dtype=PATHS[name][0], max_model_len=512,
                                              num_gpu_blocks_override=64, max_num_seqs=4,
                                              quant_activations=PATHS[name][1]))
               for name in names}
    parts = {name: time_parts(runner) for name, runner in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_ in range(args.rounds):
        for name, runner in runners.items():
            rid = f"r{round_}"
            driver = StepDriver(runner)
            driver.add(rid, PROMPT, max_new=49)
            driver.step()  # the prefill and the first token, untimed
            for spent in parts[name].values():
                spent.clear()
            while not driver.requests[rid].done:
                start = time.perf_counter()
                driver.step()
                times[name].append(time.perf_counter() - start)
    print(f"# load average {os.getloadavg()[0]:.1f}, {torch.get_num_threads()} threads")
    part_names = [p for p, _, _ in PARTS]
    print(f"{'path':10} {'best ms':>8} {'median ms':>9} {'steps':>6} "
          + " ".join(f"{p:>8}" for p in part_names))
    for name, ts in times.items():
        cells = [f"{statistics.median(parts[name][p]) * 1e3:8.2f}" if parts[name].get(p)
                 else f"{'-':>8}" for p in part_names]
        print(f"{name:10} {min(ts) * 1e3:8.1f} {statistics.median(ts) * 1e3:9.1f} "
              f"{len(ts):6d} " + " ".join(cells))


if __name__ == "__main__":
    main()
