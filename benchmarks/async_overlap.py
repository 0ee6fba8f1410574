"""Async scheduling across the RPC, measured: N concurrent greedy requests of M output
tokens each on one real worker process, once with async scheduling (two steps in
flight) and once without (one), reporting output tokens/s, mean inter-token latency
and the worker's idle time between steps (mean, p99, share of its wall time) from
the timings the worker reports with every step.

    python benchmarks/async_overlap.py [--num-requests 64] [--max-tokens 128] [--json]

The worker runs as its own process (`python -m worker_svc.server`), exactly as
deployed; the scheduler side is the scheduler service's own Engine and WorkerGroup,
in this process, so every step's StepTimings can be kept. Clients are sessions on
that Engine (no frontend: detokenization would only add CPU load to both runs).
The first step of a run is left out of the idle figures: its idle time is the
wait for the run to start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine import CLOSED, Engine
from scheduler_svc.engine_errors import Failure
from scheduler_svc.server import WorkerGroup
from shared.types import ModelInfo, ModelRunnerOutput, SamplingParams, StepTimings


class TimedGroup(WorkerGroup):
    """The real worker group; keeps every collected step's worker timings."""

    def __init__(self, addresses) -> None:
        super().__init__(addresses)
        self.timings: list[StepTimings] = []

    def collect(self) -> ModelRunnerOutput:
        result = super().collect()
        self.timings.append(result.timings)
        return result


@dataclass(slots=True)
class RunResult:
    tokens_per_s: float
    mean_itl_ms: float
    worker_idle_ms_mean: float
    worker_idle_ms_p99: float
    worker_idle_share: float
    num_steps: int
    num_output_tokens: int
    wall_s: float
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__ if f != "extra"} | self.extra


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(args, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "worker_svc.server", "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", "0", "--log-level", "warning",
            "--log-format", "json", "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.num_requests),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--num-gpu-blocks-override", str(blocks_needed(args)), "--device", args.device]
    if args.model:
        argv += ["--model", args.model]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.worker_threads))
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def blocks_needed(args) -> int:
    per_request = -(-(args.prompt_len + args.max_tokens) // 16)
    longest = -(-args.max_model_len // 16)
    return max(args.num_requests * per_request, longest) + 2  # + the null block, + a spare


def handshake(group: WorkerGroup, worker: subprocess.Popen, timeout_s: float) -> ModelInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited: {worker.stderr.read().decode()[-2000:]}")
        try:
            return group.handshake(timeout_s=2.0)
        except grpc.RpcError as e:
            if time.monotonic() > deadline or e.code() not in (
                    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise


def run_requests(engine: Engine, session, prompts: list[list[int]], max_tokens: int,
                 eos: list[int], tag: str) -> tuple[float, dict[str, list[tuple[float, int]]]]:
    """Add every request at once; return the start time and, per request, each
    output's (arrival time, number of tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    arrivals: dict[str, list[tuple[float, int]]] = {}
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        req_id = f"{tag}-{i}"
        arrivals[req_id] = []
        engine.add(session, Request(req_id, prompt, params, eos, arrival_time=time.time()))
    pending = set(arrivals)
    while pending:
        items = session.outbox.get()
        now = time.perf_counter()
        if items is CLOSED:
            raise RuntimeError("the session closed")
        for item in items:
            if isinstance(item, Failure):
                raise RuntimeError(f"{item.req_id}: {item.code} {item.message}")
            if item.new_token_ids:
                arrivals[item.req_id].append((now, len(item.new_token_ids)))
            if item.finished:
                pending.discard(item.req_id)
    return t0, arrivals


def summarize(t0: float, arrivals, timings: list[StepTimings]) -> RunResult:
    end = max(t for outs in arrivals.values() for t, _ in outs)
    num_tokens = sum(n for outs in arrivals.values() for _, n in outs)
    itls = []
    for outs in arrivals.values():
        n = sum(k for _, k in outs)
        if n > 1:
            itls.append((outs[-1][0] - outs[0][0]) / (n - 1) * 1e3)
    idle = np.array([t.idle_ms for t in timings[1:]]) if len(timings) > 1 else np.zeros(1)
    wall_ms = (timings[-1].end_unix_s - timings[0].start_unix_s) * 1e3
    return RunResult(
        tokens_per_s=num_tokens / (end - t0), mean_itl_ms=float(np.mean(itls)),
        worker_idle_ms_mean=float(idle.mean()),
        worker_idle_ms_p99=float(np.percentile(idle, 99)),
        worker_idle_share=float(idle.sum() / wall_ms) if wall_ms > 0 else 0.0,
        num_steps=len(timings), num_output_tokens=num_tokens, wall_s=end - t0,
        extra={"worker_busy_ms_mean": float(np.mean(
            [t.prepare_ms + t.forward_ms + t.sample_ms for t in timings])),
            # the step's parts: what an inter-token latency beyond them is spent outside
            **{f"worker_{part}_ms_mean": float(np.mean([getattr(t, f"{part}_ms")
                                                       for t in timings]))
               for part in ("prepare", "forward", "sample")}})


def run_mode(args, address: str, worker: subprocess.Popen, async_scheduling: bool,
             prompts: list[list[int]], warmup: list[list[int]]) -> RunResult:
    group = TimedGroup([address])
    info = handshake(group, worker, args.startup_timeout_s)
    cfg = SchedulerConfig(block_size=info.block_size, max_model_len=args.max_model_len,
                          max_num_seqs=args.num_requests,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          async_scheduling=async_scheduling)
    engine = Engine(Scheduler(cfg, info.num_kv_blocks), group, info, cfg.max_model_len)
    group.open_streams()
    engine.start()
    try:
        session = engine.open_session()
        mode = "async" if async_scheduling else "sync"
        # warm-up: first-call costs of every batch shape, off the record
        run_requests(engine, session, warmup, 4, info.eos_token_ids, f"{mode}-warm")
        group.timings.clear()
        t0, arrivals = run_requests(engine, session, prompts, args.max_tokens,
                                    info.eos_token_ids, mode)
        return summarize(t0, arrivals, list(group.timings))
    finally:
        engine.stop()
        group.close()


def make_prompts(args, n: int, vocab_size: int = 49152) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)  # distinct prompts: no prefix-cache hits
    return [rng.integers(100, vocab_size, args.prompt_len).tolist() for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--device", default="auto")
    p.add_argument("--worker-threads", type=int, default=1,
                   help="torch threads of the worker; the rest of the cores are the scheduler's")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: --prompt-len + --max-tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--modes", default="async,sync", help="comma list of async, sync")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("async", "sync") for m in modes):
        p.error("--modes takes async and/or sync")
    if args.max_model_len is None:
        args.max_model_len = args.prompt_len + args.max_tokens
    if args.prompt_len + args.max_tokens > args.max_model_len:
        p.error("--prompt-len + --max-tokens must fit in --max-model-len")

    port = free_port()
    worker = start_worker(args, port)
    try:
        prompts = make_prompts(args, 2 * args.num_requests)
        measured, warmup = prompts[:args.num_requests], prompts[args.num_requests:]
        results = {m: run_mode(args, f"127.0.0.1:{port}", worker, m == "async", measured,
                               warmup) for m in modes}
    finally:
        worker.terminate()
        worker.wait(30)
    if args.json:
        print(json.dumps({m: r.as_dict() for m, r in results.items()}, indent=2))
        return 0
    print(f"{args.num_requests} requests x {args.max_tokens} tokens, prompts of "
          f"{args.prompt_len}; worker threads {args.worker_threads}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':6} {'tok/s':>8} {'ITL ms':>8} {'idle mean ms':>13} {'idle p99 ms':>12} "
          f"{'idle share':>11} {'steps':>6} {'prepare ms':>11} {'forward ms':>11} "
          f"{'sample ms':>10}")
    for m, r in results.items():
        parts = [r.extra[f"worker_{part}_ms_mean"] for part in ("prepare", "forward", "sample")]
        print(f"{m:6} {r.tokens_per_s:8.1f} {r.mean_itl_ms:8.1f} {r.worker_idle_ms_mean:13.2f} "
              f"{r.worker_idle_ms_p99:12.2f} {r.worker_idle_share:11.2%} {r.num_steps:6d} "
              f"{parts[0]:11.2f} {parts[1]:11.2f} {parts[2]:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
