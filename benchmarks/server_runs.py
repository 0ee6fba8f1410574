"""Running and measuring one server, for the benchmarks that compare whole servers
(side_by_side.py, spec_decode.py, stack_ceiling.py): wait until it answers a request
(wait_ready), run serve_bench.py against it as a child process while counting the
cores its process tree, the client and everything else on the machine used (bench,
busy_ticks, tree_ticks, cpu_by_process), read its processes' peak memory once after
a run (stack_memory_now) and stop its process group (stop); plus what a report
records of the machine (cpu_info) and which API a model is driven through
(has_chat_template).

Each of those scripts builds its own server commands, ports and logs; this module
holds what they measure alike. It is imported, not run.
"""

from __future__ import annotations

import argparse
import json
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
TICKS = os.sysconf("SC_CLK_TCK")


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


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether a checkpoint (or GGUF view) directory carries a chat template, read where
    the frontend reads it (frontend_svc/request/tokenizer.py)."""
    path = Path(model_dir)
    if (path / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float,
               endpoint: str = "chat") -> None:
    """Until one short request to the benchmark's endpoint succeeds (a 503 while
    loading does not count)."""
    deadline = time.monotonic() + timeout_s
    if endpoint == "chat":
        path, body = "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, body = "/completions", {"prompt": "hi"}
    body["max_tokens"] = 1
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            model = httpx.get(base_url + "/models", timeout=5).json()["data"][0]["id"]
            reply = httpx.post(base_url + path, json={"model": model, **body}, timeout=60)
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
          args: argparse.Namespace, endpoint: str = "chat") -> dict:
    """One serve_bench run as a child process; its JSON report plus machine load."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        argv = [sys.executable, str(HERE / "serve_bench.py"), "--base-url", base_url,
                "--workload", "essay", "--endpoint", endpoint,
                "--num-requests", str(num_requests),
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


def stop(proc: subprocess.Popen) -> None:
    """The server's whole process group; one that already exited is left as it is."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and its flags (/proc/cpuinfo), for every figure's record."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in lines
                  if line.startswith("flags")), [])
    return name, flags
