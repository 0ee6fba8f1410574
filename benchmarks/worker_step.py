"""Step time of the worker on the default model: decode batches and prefill chunks,
and the fitted step-time model the scheduler simulator uses:

    step_ms = d + s * num_seqs + p * num_prefill_tokens

    python benchmarks/worker_step.py [--threads 2] [--quick] [--json out.json]
    python benchmarks/worker_step.py --tensor-parallel-size 2 [--threads 1] [--quick]

--threads 0 (the default) leaves the count to the worker's compute plan, as a
deployed worker does: the usable cores split among the ranks on this host, so TP=1
runs on all of them and each of N ranks on its share (each table says how many).

With --tensor-parallel-size N the same points run first unsplit (TP=1), then on N
ranks (this process is rank 0; it starts ranks 1..N-1 as processes that replay the
same steps, joined over gloo), and a last table puts the two step times side by side.

Each decode point runs B requests with 128-token prompts, then times decode steps
(context 128-140). Each prefill point times one fresh chunk of N tokens. Reported:
the whole execute() wall time and the forward pass alone, plus CPU time of this
process (less sensitive than wall time to other work on a shared machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from shared.model_files.default_model import resolve_model
from shared.types import (CachedRequestData, NewRequestData, SamplingParams,
                          SchedulerOutput)
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner

PROMPT_LEN = 128


class Bench:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.free = list(range(runner.num_kv_blocks - 1, 0, -1))
        self.live: dict[str, list] = {}  # req_id -> [blocks, computed, num_tokens]
        self.step_id = 0
        self.next_id = 0

    def _run(self, new, cached, num_sched, finished=()):
        step = SchedulerOutput(step_id=self.step_id, scheduled_new_reqs=new,
                               scheduled_cached_reqs=cached, num_scheduled_tokens=num_sched,
                               total_num_scheduled_tokens=sum(num_sched.values()),
                               finished_req_ids=set(finished))
        self.step_id += 1
        wall, cpu = time.perf_counter(), time.process_time()
        out = self.runner.execute(step)
        return out, time.perf_counter() - wall, time.process_time() - cpu

    def prefill(self, num_reqs: int, prompt_len: int):
        """Admit num_reqs fresh requests with one step each chunk of their whole prompt."""
        rng = np.random.default_rng(self.next_id)
        new, num_sched = [], {}
        for _ in range(num_reqs):
            req_id = f"r{self.next_id}"
            self.next_id += 1
            n_blocks = -(-(prompt_len + 1) // self.runner.block_size)
            blocks = [self.free.pop() for _ in range(n_blocks)]
            prompt = rng.integers(100, 40000, prompt_len).tolist()
            new.append(NewRequestData(req_id, prompt, SamplingParams(temperature=0.0,
                                                                     max_tokens=1 << 20),
                                      blocks, 0))
            num_sched[req_id] = prompt_len
            self.live[req_id] = [blocks, prompt_len, prompt_len + 1]
        return self._run(new, CachedRequestData(), num_sched)

    def decode(self):
        cached, num_sched = CachedRequestData(), {}
        bs = self.runner.block_size
        for req_id, state in self.live.items():
            blocks, computed, num_tokens = state
            new_blocks = []
            if (computed + 1) > len(blocks) * bs:
                new_blocks = [self.free.pop()]
                blocks.extend(new_blocks)
            cached.append(req_id, False, new_blocks, computed)
            num_sched[req_id] = 1
            state[1], state[2] = computed + 1, num_tokens + 1
        return self._run([], cached, num_sched)

    def finish_all(self):
        finished = list(self.live)
        for blocks, _, _ in self.live.values():
            self.free.extend(reversed(blocks))
        self.live.clear()
        self._run([], CachedRequestData(), {}, finished)


def measure(runner: ModelRunner, decode_batches, prefill_chunks, decode_steps, reps):
    bench = Bench(runner)
    rows = []
    for b in decode_batches:
        for start in range(0, b, 32):  # admit in chunks of at most 32 x 128 tokens
            bench.prefill(min(32, b - start), PROMPT_LEN)
        bench.decode()  # warm-up
        samples = [bench.decode() for _ in range(decode_steps)]
        bench.finish_all()
        rows.append(_row("decode", b, 0, samples))
    for n in prefill_chunks:
        samples = []
        for _ in range(reps):
            samples.append(bench.prefill(1, n))
            bench.finish_all()
        rows.append(_row("prefill", 1, n, samples))
    return rows


def _row(kind, num_seqs, prefill_tokens, samples):
    return {
        "kind": kind, "num_seqs": num_seqs, "prefill_tokens": prefill_tokens,
        "step_ms": statistics.median(s[1] for s in samples) * 1e3,
        "forward_ms": statistics.median(s[0].timings.forward_ms for s in samples),
        "cpu_ms": statistics.median(s[2] for s in samples) * 1e3,
    }


def fit(rows, key="step_ms"):
    """step_ms = d + s * num_seqs + p * prefill_tokens, least squares on relative
    error: plain least squares lets the multi-second prefill points drown the
    decode points (and can drive d negative)."""
    a = np.array([[1.0, r["num_seqs"], r["prefill_tokens"]] for r in rows])
    y = np.array([r[key] for r in rows])
    (d, s, p), *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    worst = float(np.max(np.abs(a @ np.array([d, s, p]) / y - 1.0)))
    return {"fixed_ms": float(d), "per_seq_ms": float(s), "per_prefill_token_ms": float(p),
            "worst_relative_error": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank; 0: the compute plan's (cores // ranks)")
    ap.add_argument("--quick", action="store_true", help="fewer points, for a smoke run")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="bfloat16 on CPU: bf16 matmul weights, fp32 activations")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--quantization", default=None, choices=("int8",),
                    help="int8 weights for steps of at most 32 tokens (docs/worker.md)")
    ap.add_argument("--decode-batches", default=None,
                    help="comma list instead of the default 1,8,32,64,128")
    ap.add_argument("--prefill-chunks", default=None,
                    help="comma list instead of the default 128..4096 ('' for none)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--model", default=None,
                    help="checkpoint directory (default: the default model)")
    ap.add_argument("--max-model-len", type=int, default=4096 + 16,
                    help="the runner's; at least the longest prefill chunk")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="also time the points on this many ranks, against TP=1")
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)  # helper ranks
    ap.add_argument("--master-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    decode_batches = [1, 8, 32, 64, 128] if not args.quick else [1, 8]
    prefill_chunks = [128, 256, 512, 1024, 2048, 4096] if not args.quick else [128, 512]
    if args.decode_batches:
        decode_batches = [int(b) for b in args.decode_batches.split(",")]
    if args.prefill_chunks is not None:
        prefill_chunks = [int(n) for n in args.prefill_chunks.split(",") if n]
    points = (decode_batches, prefill_chunks, args.decode_steps, args.reps)
    tp = args.tensor_parallel_size
    if args.rank > 0:  # a helper rank: replay the same steps in lockstep with rank 0
        runner = _runner(args, decode_batches, args.rank, tp, args.master_port)
        measure(runner, *points)
        runner.tp.close()
        return
    t0 = time.perf_counter()
    runner = _runner(args, decode_batches, 0, 1, 0)
    name, dtype = runner.model_info().model_name, runner.dtype
    threads = runner.compute_plan.threads
    rows = measure(runner, *points)
    _print_rows(f"{name}, {dtype}, {threads} threads, TP=1", rows, t0)
    print(f"compute plan: {runner.compute_plan.summary()}")
    results = {"rows": rows, "fit": fit(rows), "threads": threads,
               "compute_plan": runner.compute_plan.summary()}
    if tp > 1:
        del runner
        gc.collect()  # the unsplit weights and KV go before the ranks load theirs
        t0 = time.perf_counter()
        tp_rows, tp_plan = _measure_split(args, decode_batches, points)
        _print_rows(f"{name}, {dtype}, {tp_plan.threads} thread(s) per rank, TP={tp}",
                    tp_rows, t0)
        print(f"compute plan of rank 0: {tp_plan.summary()}")
        _print_comparison(rows, tp_rows, tp)
        results["tensor_parallel"] = {"size": tp, "rows": tp_rows, "fit": fit(tp_rows),
                                      "compute_plan": tp_plan.summary()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _runner(args, decode_batches, rank: int, tp: int, master_port: int) -> ModelRunner:
    max_blocks = max(decode_batches) * (-(-(PROMPT_LEN + 2 * args.decode_steps + 2) // 16))
    return ModelRunner(WorkerConfig(
        model=args.model, device="cpu", dtype=args.dtype, quantization=args.quantization,
        load_format=args.load_format, max_model_len=args.max_model_len,
        max_num_seqs=max(decode_batches),
        num_gpu_blocks_override=max(max_blocks, 4096 // 16 + 2) + 1,
        tensor_parallel_rank=rank, tensor_parallel_size=tp, master_port=master_port,
        cpu_threads=args.threads))


def _measure_split(args, decode_batches, points):
    tp = args.tensor_parallel_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    helpers = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r),
                                 "--master-port", str(port)]) for r in range(1, tp)]
    try:
        runner = _runner(args, decode_batches, 0, tp, port)
        rows = measure(runner, *points)
        runner.tp.close()
        return rows, runner.compute_plan
    finally:
        for h in helpers:
            if h.wait(timeout=120) != 0:
                raise SystemExit(f"helper rank exited with {h.returncode}")


def _print_rows(title: str, rows, t0: float) -> None:
    print(f"# worker step benchmark: {title}, {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.perf_counter() - t0:.0f} s")
    print(f"{'kind':8s} {'seqs':>5s} {'prefill':>8s} {'step ms':>9s} {'fwd ms':>9s} "
          f"{'cpu ms':>9s} {'tok/s':>8s} {'fwd tok/s':>9s}")
    for r in rows:
        toks = r["num_seqs"] if r["kind"] == "decode" else r["prefill_tokens"]
        print(f"{r['kind']:8s} {r['num_seqs']:5d} {r['prefill_tokens']:8d} "
              f"{r['step_ms']:9.1f} {r['forward_ms']:9.1f} {r['cpu_ms']:9.1f} "
              f"{toks / r['step_ms'] * 1e3:8.1f} {toks / r['forward_ms'] * 1e3:9.1f}")
    model = fit(rows) if len(rows) >= 3 else {"fixed_ms": 0.0, "per_seq_ms": 0.0,
                                                 "per_prefill_token_ms": 0.0,
                                                 "worst_relative_error": float("nan")}
    print("fitted step time: step_ms = {fixed_ms:.2f} + {per_seq_ms:.3f} * num_seqs "
          "+ {per_prefill_token_ms:.4f} * prefill_tokens "
          "(worst point off by {worst_relative_error:.0%})".format(**model))
    by_seqs = {r["num_seqs"]: r for r in rows if r["kind"] == "decode"}
    for b in (1, 64):
        if b in by_seqs:
            r = by_seqs[b]
            print(f"decode {b:3d} seqs: {b / r['step_ms'] * 1e3:.1f} tok/s per step, "
                  f"{b / r['forward_ms'] * 1e3:.1f} tok/s forward alone")


def _print_comparison(rows, tp_rows, tp: int) -> None:
    print(f"# step time, TP=1 vs TP={tp}")
    print(f"{'kind':8s} {'seqs':>5s} {'prefill':>8s} {'TP=1 ms':>9s} {f'TP={tp} ms':>9s} "
          f"{'speed-up':>8s}")
    for a, b in zip(rows, tp_rows):
        print(f"{a['kind']:8s} {a['num_seqs']:5d} {a['prefill_tokens']:8d} "
              f"{a['step_ms']:9.1f} {b['step_ms']:9.1f} {a['step_ms'] / b['step_ms']:7.2f}x")


if __name__ == "__main__":
    main()
