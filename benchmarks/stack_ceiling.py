"""The serving stack's own ceiling: streamed output tokens/s that the frontend,
scheduler and wire sustain when the model costs nothing.

    python benchmarks/stack_ceiling.py [--concurrency 256,1000] [--max-tokens 128]
        [--json out.json]

Starts `gapserve serve --load-format dummy --zero-cost-steps` (the real model's
config and tokenizer, random weights, steps that skip the forward pass and answer
made-up ordinary tokens at once; no KV cache memory is touched), then runs
serve_bench.py at each concurrency: as many chat requests as streams, each streaming
--max-tokens tokens (EOS ignored). A GPU worker produces tens of thousands of tokens
per second on a small model; this says whether the stack in front of it keeps up.
Reported per point: output tokens/s, TTFT, ITL, and the cores each process used
(frontend, scheduler, worker, and the benchmark client, which shares the machine:
on a 2-core box the client's share is part of the ceiling measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import server_runs  # noqa: E402  (wait_ready(), bench(), stop(): as side_by_side.py measures)

ROOT = HERE.parent


def serve_argv(args: argparse.Namespace) -> list[str]:
    streams = max(args.concurrency)
    return [sys.executable, "-m", "gapserve", "serve", "--model", args.model,
            "--load-format", "dummy", "--zero-cost-steps",
            "--max-num-seqs", str(streams), "--max-model-len", "1024",
            # blocks for every stream's prompt and output; none of it is allocated
            "--kv-cache-memory", str(args.kv_blocks_bytes),
            "--http-port", str(args.port), "--grpc-port", str(args.port + 51),
            "--scheduler-port", str(args.port + 52), "--worker-port", str(args.port + 53),
            "--scheduler-metrics-port", "0", "--worker-metrics-port", "0",
            "--api-server-count", str(args.api_server_count),
            "--num-scheduler-steps", str(args.num_scheduler_steps), "--log-level", "warning"]


def role(cmd: str) -> str:
    for name in ("frontend", "scheduler", "worker", "serve"):
        if f"gapserve {name}" in cmd:
            return name
    return cmd.split()[0] if cmd else "?"


def run(args: argparse.Namespace) -> dict:
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    log = open(Path(args.log_dir) / "stack_ceiling.log", "wb")
    proc = subprocess.Popen(serve_argv(args), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)
    base_url = f"http://127.0.0.1:{args.port}/v1"
    points = []
    try:
        server_runs.wait_ready(base_url, proc, 300)
        for conc in args.concurrency:
            report = server_runs.bench(base_url, proc.pid, conc, conc * args.rounds,
                                       min(conc, 16), args)
            m = report["machine"]
            cores, frontends = {}, 0
            for key, value in m["server_cores_by_process"].items():
                name = role(key.split(" ", 1)[1])
                cores[name] = cores.get(name, 0.0) + value
                frontends += name == "frontend"
            cores["client"] = m["client_cores"]
            points.append({"concurrency": conc, "frontends": frontends,
                           "output_tok_s": report["output_throughput"],
                           "ttft_ms": report["ttft_ms"], "itl_ms": report["itl_ms"],
                           "errors": report.get("errors"),
                           "cores": cores, "other_cores": m["other_cores"],
                           "load_avg_1m_after": m["load_avg_1m_after"]})
            print(f"{conc} streams: {report['output_throughput']:.0f} tok/s, cores "
                  + ", ".join(f"{k} {v:.2f}" for k, v in cores.items()), file=sys.stderr)
    finally:
        server_runs.stop(proc)
        log.close()
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cores": os.cpu_count(), "max_tokens": args.max_tokens,
            "num_scheduler_steps": args.num_scheduler_steps, "points": points}


def markdown(result: dict) -> str:
    lines = ["| streams | frontends | scheduler steps | output tok/s | mean TTFT s | "
             "mean ITL ms | frontend | scheduler | worker | client | other load | (cores) |",
             "|" + " --- |" * 12]
    steps = result.get("num_scheduler_steps", 1)
    for p in result["points"]:
        c = p["cores"]
        lines.append(f"| {p['concurrency']} | {p['frontends']} | {steps} | "
                     f"{p['output_tok_s']:.0f} | "
                     f"{p['ttft_ms']['mean'] / 1e3:.2f} | {p['itl_ms']['mean'] or 0:.1f} | "
                     + " | ".join(f"{c.get(k, 0.0):.2f}" for k in
                                  ("frontend", "scheduler", "worker", "client"))
                     + f" | {p['other_cores']:.2f} | |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="256,1000",
                   help="comma list of concurrent streams")
    p.add_argument("--rounds", type=int, default=1,
                   help="requests per stream at each point (num requests = streams x rounds)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default=str(Path.home() / ".cache/gapserve/SmolLM2-135M-Instruct"),
                   help="its config.json and tokenizer are used, not its weights")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="frontend processes (gapserve serve --api-server-count)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="multi-step decode: forward passes (here: zero-cost steps) per "
                        "scheduler step, so per gRPC message (docs/scheduling.md)")
    p.add_argument("--port", type=int, default=18400)
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency takes a comma list of integers, got {args.concurrency!r}")
    if min(args.concurrency) < 1 or min(args.max_tokens, args.rounds, args.api_server_count,
                                        args.num_scheduler_steps) < 1:
        p.error("--concurrency, --max-tokens, --rounds, --api-server-count and "
                "--num-scheduler-steps must be at least 1")
    # 64-token blocks' worth per stream is plenty for a ~40-token prompt + output
    per_stream = 1024 * 30 * 2 * 3 * 64 * 4  # tokens x the default model's KV bytes/token
    args.kv_blocks_bytes = max(args.concurrency) * per_stream
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['date']}, {result['cores']} cores, {args.max_tokens} tokens a stream\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
