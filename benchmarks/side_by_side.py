"""gapserve, vLLM's CPU build and llama.cpp's llama-server on the issue's workload, one
server at a time, in one run:

    python benchmarks/side_by_side.py [--servers gapserve,vllm,llamacpp] [--json out.json]

For each server: start it (its own process group, log under --log-dir), wait until a
one-token chat request succeeds, run serve_bench.py at --concurrency (64 essay
requests, 128 tokens, greedy, EOS ignored) and one at a time (--single-requests),
read its process tree's peak memory (VmHWM) after each, then stop it. Prints a markdown table
with gapserve/peer ratios from this run. gapserve's and vLLM's KV caches get
--kv-cache-gib; llama-server gets --concurrency slots of a fixed context each (-np, -c),
since it sizes its cache in tokens, not bytes.

How busy the machine was matters on a shared box, so each run also reports the load
average and the cores used by processes that are neither the server nor the client.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 2**30
TICKS = os.sysconf("SC_CLK_TCK")


def server_commands(args: argparse.Namespace) -> dict[str, dict]:
    """name -> argv, env, port, and how to learn its KV cache's size."""
    kv_bytes = int(args.kv_cache_gib * GIB)
    return {
        "gapserve": {
            "argv": [sys.executable, "-m", "gapserve", "serve", "--model", args.model,
                     "--dtype", "float32", "--kv-cache-memory", str(kv_bytes),
                     "--http-port", str(args.port), "--grpc-port", str(args.port + 51),
                     "--scheduler-port", str(args.port + 52), "--worker-port",
                     str(args.port + 53), "--scheduler-metrics-port", "0",
                     "--worker-metrics-port", "0", "--log-level", "warning"],
            "env": {}, "port": args.port, "kv_from": f"127.0.0.1:{args.port + 51}"},
        "vllm": {
            "argv": [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                     "--model", args.model, "--dtype", "float32", "--port",
                     str(args.port + 100), "--max-model-len", "2048"],
            # vLLM's CPU KV cache is sized in whole or fractional GiB by this variable
            "env": {"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}"},
            "port": args.port + 100, "kv_bytes": kv_bytes},
        "llamacpp": llama_server_spec(args),
    }


def llama_server_spec(args: argparse.Namespace) -> dict:
    """llama-server on the fp32 GGUF: one slot per concurrent request, continuous
    batching, every core (-t, -tb), CPU only (--device none)."""
    slots = args.concurrency
    # per-slot context: the essay prompt (~41 tokens) plus the output, in steps of 256
    slot_ctx = 256 * math.ceil((args.max_tokens + 128) / 256)
    threads = str(os.cpu_count() or 1)
    return {
        "argv": [args.llama_server, "-m", args.llama_gguf, "--host", "127.0.0.1",
                 "--port", str(args.port + 200), "-a", Path(args.model).name,
                 "-np", str(slots), "-c", str(slots * slot_ctx), "-cb",
                 "-t", threads, "-tb", threads, "--device", "none", "--no-webui"],
        "env": {}, "port": args.port + 200,
        "kv_bytes": llama_kv_bytes(args.model, slots * slot_ctx)}


def llama_kv_bytes(model_dir: str, ctx_tokens: int) -> int | None:
    """Size of llama-server's KV cache: K and V for every layer and token, f16 (its
    default cache type); None when the checkpoint's config cannot be read."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        return ctx_tokens * cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * 2
    except (OSError, ValueError, KeyError, TypeError):
        return None


def busy_ticks() -> int:
    """CPU ticks the whole machine spent busy (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6))


def tree_ticks(root: int) -> dict[int, tuple[str, int]]:
    """pid -> (command line, CPU ticks) of a process and its live descendants."""
    sys.path.insert(0, str(HERE))
    import stack_memory

    ticks = {}
    for pid in stack_memory.find_pids(roots=[root]):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            ticks[pid] = (cmd.strip(), int(stat[11]) + int(stat[12]))  # utime, stime
        except (OSError, IndexError):
            pass
    return ticks


def cpu_by_process(before: dict, after: dict, wall_s: float) -> dict[str, float]:
    """Cores each server process used between two tree_ticks readings."""
    return {f"{pid} {cmd[:90]}": (ticks - before.get(pid, (cmd, 0))[1]) / TICKS / wall_s
            for pid, (cmd, ticks) in after.items()}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until one short chat request succeeds (a 503 while loading does not count)."""
    deadline = time.monotonic() + timeout_s
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            model = httpx.get(base_url + "/models", timeout=5).json()["data"][0]["id"]
            reply = httpx.post(base_url + "/chat/completions", json={"model": model, **body},
                               timeout=60)
            if reply.status_code == 200:
                return
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        time.sleep(2)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")


def stack_memory_now(pid: int, kv_from: str | None, kv_bytes: int | None) -> dict:
    """Peak resident memory of the server's processes, read once after a run: each
    process's own peak (VmHWM) summed, so nothing samples /proc while it is measured
    (sampling every 0.25 s took ~0.17 of a core on this 2-core machine)."""
    sys.path.insert(0, str(HERE))
    import stack_memory

    stack = stack_memory.measure(stack_memory.find_pids(roots=[pid]))
    report = {"sum_peak_rss_bytes": stack.sum_peak_rss_bytes, "rss_bytes": stack.rss_bytes,
              "pss_bytes": stack.pss_bytes,
              "processes": {f"{p.pid} {p.cmd[:90]}": p.peak_rss_bytes
                            for p in stack.processes}}
    if kv_from:
        kv_bytes = stack_memory.gapserve_kv_cache_bytes(kv_from)
    if kv_bytes is not None:
        report["kv_cache_bytes"] = kv_bytes
    return report


def bench(base_url: str, pid: int, concurrency: int, num_requests: int, warmup: int,
          args: argparse.Namespace) -> dict:
    """One serve_bench run as a child process; its JSON report plus machine load."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        argv = [sys.executable, str(HERE / "serve_bench.py"), "--base-url", base_url,
                "--workload", "essay", "--num-requests", str(num_requests),
                "--concurrency", str(concurrency), "--max-tokens", str(args.max_tokens),
                "--ignore-eos", "--temperature", "0", "--warmup", str(warmup),
                "--json", str(out), "--quiet"]
        start = (time.monotonic(), busy_ticks(), tree_ticks(pid), _children_cpu_s())
        client = subprocess.run(argv, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                capture_output=True, text=True)
        end = (time.monotonic(), busy_ticks(), tree_ticks(pid), _children_cpu_s())
        if client.returncode != 0 or not out.exists():
            raise RuntimeError(f"serve_bench failed: {client.stderr.strip()[-2000:]}")
        report = json.loads(out.read_text())
    wall = end[0] - start[0]
    by_process = cpu_by_process(start[2], end[2], wall)
    server_cores = sum(by_process.values())
    client_cores = (end[3] - start[3]) / wall
    report["machine"] = {
        "load_avg_1m_after": os.getloadavg()[0],
        "busy_cores": (end[1] - start[1]) / TICKS / wall,
        "server_cores": server_cores,
        "client_cores": client_cores,
        # other engineers' work on a shared machine; near 0 on a quiet one
        "other_cores": (end[1] - start[1]) / TICKS / wall - server_cores - client_cores,
        "server_cores_by_process": by_process,
    }
    return report


def run_server(name: str, spec: dict, args: argparse.Namespace) -> dict:
    base_url = f"http://127.0.0.1:{spec['port']}/v1"
    log_path = Path(args.log_dir) / f"side_by_side-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        started = time.monotonic()
        wait_ready(base_url, proc, args.startup_timeout)
        print(f"{name}: ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
        result = {"command": " ".join(spec["argv"]), "env": spec["env"]}
        for key, conc, num, warm in (("concurrent", args.concurrency, args.concurrency, 2),
                                     ("single", 1, args.single_requests, 1)):
            report = bench(base_url, proc.pid, conc, num, warm, args)
            report["memory"] = stack_memory_now(proc.pid, spec.get("kv_from"),
                                                spec.get("kv_bytes"))
            result[key] = report
            print(f"{name} {key}: {report['output_throughput']:.1f} tok/s, mean TTFT "
                  f"{report['ttft_ms']['mean']:.0f} ms, other load "
                  f"{report['machine']['other_cores']:.2f} cores", file=sys.stderr)
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    """One row per server, then gapserve/peer ratios of throughput (higher is better)."""
    if not results["servers"]:
        return "(no server was measured)"
    concurrency = next(iter(results["servers"].values()))["concurrent"]["concurrency"]
    head = (f"| server | {concurrency} concurrent: tok/s | mean TTFT s | p99 TTFT s | "
            "mean ITL ms | single tok/s | single ITL ms | peak RSS GB | KV cache GB (share) | "
            "other load, cores |")
    lines = [head, "|" + " --- |" * 10]
    for name, r in results["servers"].items():
        c, s = r["concurrent"], r["single"]
        mem = s.get("memory") or {}  # read after both runs: the peaks of the whole session
        peak = mem.get("sum_peak_rss_bytes", 0)
        kv = mem.get("kv_cache_bytes")
        kv_cell = "-" if kv is None else f"{kv / 1e9:.2f} ({100 * kv / peak:.0f}%)"
        lines.append(
            f"| {name} | {c['output_throughput']:.1f} | {c['ttft_ms']['mean'] / 1e3:.2f} | "
            f"{c['ttft_ms']['p99'] / 1e3:.2f} | {_fmt(c['itl_ms']['mean'], '.0f')} | "
            f"{s['output_throughput']:.1f} | {_fmt(s['itl_ms']['mean'], '.1f')} | "
            f"{peak / 1e9:.2f} | {kv_cell} | "
            f"{c['machine']['other_cores']:.2f} / {s['machine']['other_cores']:.2f} |")
    ours = results["servers"].get("gapserve")
    for name, r in results["servers"].items():
        if ours is None or name == "gapserve":
            continue
        ratio_c = ours["concurrent"]["output_throughput"] / r["concurrent"]["output_throughput"]
        ratio_s = ours["single"]["output_throughput"] / r["single"]["output_throughput"]
        lines.append(f"\ngapserve / {name}, same run: {ratio_c:.2f}x at "
                     f"{ours['concurrent']['concurrency']} concurrent, {ratio_s:.2f}x single "
                     "stream (output tokens/s)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="gapserve,vllm",
                   help="comma-separated, run in this order: gapserve, vllm, llamacpp")
    p.add_argument("--model", default=str(Path.home() / ".cache/gapserve/SmolLM2-135M-Instruct"),
                   help="the float32 checkpoint directory every server loads")
    p.add_argument("--vllm-python", default="/opt/peers/vllm-venv/bin/python")
    p.add_argument("--llama-server", default="/opt/peers/llama/bin/llama-server",
                   help="llama.cpp's llama-server binary (docs/benchmarks.md: how to get it)")
    p.add_argument("--llama-gguf",
                   default="/opt/peers/llama/models/SmolLM2-135M-Instruct-f32.gguf",
                   help="fp32 GGUF of the same checkpoint as --model, for llama-server")
    p.add_argument("--port", type=int, default=18000,
                   help="gapserve's HTTP port (its inner services +51..+53); vLLM's +100, "
                        "llama-server's +200")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--single-requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--json", default=None, metavar="PATH", help="also write all reports here")
    args = p.parse_args(argv)
    names = args.servers.split(",")
    unknown = [n for n in names if n not in ("gapserve", "vllm", "llamacpp")]
    if unknown or not names:
        p.error(f"--servers takes gapserve, vllm and/or llamacpp, got {args.servers!r}")
    if args.concurrency < 1 or args.single_requests < 1 or args.max_tokens < 1:
        p.error("--concurrency, --single-requests and --max-tokens must be at least 1")
    if not args.kv_cache_gib > 0:
        p.error("--kv-cache-gib must be positive")
    args.server_names = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = server_commands(args)
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    results = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
               "machine": f"{os.cpu_count()} cores, {cpu}", "model": args.model,
               "kv_cache_gib": args.kv_cache_gib, "servers": {}}
    for name in args.server_names:
        try:
            results["servers"][name] = run_server(name, specs[name], args)
        except (RuntimeError, OSError) as exc:  # OSError: its binary is missing
            print(f"side_by_side: {name}: {exc}", file=sys.stderr)
            return 2
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{results['date']}, {results['machine']}\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
