"""Resident memory of a serving stack: the processes whose command line matches a
pattern (or given pids and their descendants), summed, sampled while a benchmark runs.

    python benchmarks/stack_memory.py --match "gapserve "     # once, now
    python benchmarks/stack_memory.py --pid 1234 --watch 30    # peak over 30 s
    python benchmarks/stack_memory.py --serve --load 16 --out docs/results/stack_memory-DATE.json
        # starts `gapserve serve` (default model and flags, plus any --serve-arg),
        # records each service's RSS once ready and again after --load requests
    python benchmarks/stack_memory.py --serve --fill-pool --out ...
        # and then with the KV pool full: concurrent prompts of random token ids
        # (no shared prefix) whose tokens add up to more than the pool holds

Each process is named by the service it runs (serve, frontend, scheduler, worker-0):
the report's "services" maps a name to its RSS and "total_rss_bytes" sums them.

Linux only (reads /proc). Three sums, because they answer different questions:
RSS double-counts pages that processes share (one mmapped checkpoint, the Python
runtime's libraries), PSS splits shared pages between their users, and the sum of
each process's own high-water mark (VmHWM) bounds the stack's peak from above even
where sampling missed a short spike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import urllib.request
import time
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")


@dataclass(slots=True)
class ProcessMemory:
    pid: int
    cmd: str
    rss_bytes: int
    pss_bytes: int
    peak_rss_bytes: int  # VmHWM: this process's own high-water mark


@dataclass(slots=True)
class StackMemory:
    processes: list[ProcessMemory] = field(default_factory=list)

    @property
    def rss_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.processes)

    @property
    def pss_bytes(self) -> int:
        return sum(p.pss_bytes for p in self.processes)

    @property
    def sum_peak_rss_bytes(self) -> int:
        return sum(p.peak_rss_bytes for p in self.processes)


def _status_kib(pid: int, key: str) -> int:
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0  # kernel threads and zombies have no memory lines


def _pss_kib(pid: int) -> int:
    try:
        text = (PROC / str(pid) / "smaps_rollup").read_text()
    except (PermissionError, FileNotFoundError):
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def _cmdline(pid: int) -> str:
    raw = (PROC / str(pid) / "cmdline").read_bytes()
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _ppid(pid: int) -> int:
    stat = (PROC / str(pid) / "stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name in parens may hold spaces


def _all_pids() -> list[int]:
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            pid = _ppid(pid)
        except (FileNotFoundError, ProcessLookupError):
            break
    return seen


def find_pids(match: str | None = None, roots: list[int] | None = None) -> list[int]:
    """Pids whose command line contains `match`, plus `roots` and all their
    descendants; never this process or its ancestors (a benchmark started with
    the pattern on its own command line must not measure itself)."""
    mine = _ancestors(os.getpid())
    parents: dict[int, int] = {}
    chosen: set[int] = set()
    for pid in _all_pids():
        try:
            parents[pid] = _ppid(pid)
            if match and pid not in mine and match in _cmdline(pid):
                chosen.add(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    frontier = [p for p in (roots or []) if p in parents]
    chosen.update(frontier)
    while frontier:  # walk down the tree: `gapserve serve` starts the services as children
        children = [c for c, parent in parents.items() if parent in frontier]
        frontier = [c for c in children if c not in chosen]
        chosen.update(frontier)
    return sorted(chosen - mine)


def service_name(cmd: str) -> str:
    """The gapserve service a command line runs (`gapserve worker --rank 1` is
    worker-1), or the program's name for anything else."""
    words = cmd.split()
    for i, word in enumerate(words[:-1]):
        if word.endswith("gapserve") and not word.endswith("/gapserve/"):
            verb = words[i + 1]
            if verb == "worker":
                rank = words[words.index("--rank") + 1] if "--rank" in words else "0"
                return f"worker-{rank}"
            return verb
    return Path(words[0]).name if words else "?"


def by_service(processes: list[ProcessMemory]) -> dict[str, int]:
    """RSS by service name; two processes of one name (api-server copies) add up."""
    out: dict[str, int] = {}
    for p in processes:
        name = service_name(p.cmd)
        out[name] = out.get(name, 0) + p.rss_bytes
    return out


def measure(pids: list[int]) -> StackMemory:
    """One reading; processes that exited meanwhile are left out."""
    stack = StackMemory()
    for pid in pids:
        try:
            stack.processes.append(ProcessMemory(
                pid=pid, cmd=_cmdline(pid)[:120],
                rss_bytes=_status_kib(pid, "VmRSS") * 1024,
                pss_bytes=_pss_kib(pid) * 1024,
                peak_rss_bytes=_status_kib(pid, "VmHWM") * 1024))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return stack


class MemorySampler:
    """Samples the stack's summed RSS and PSS on a thread until stopped; the peak
    of the sums is what the stack held at once, as far as sampling saw."""

    def __init__(self, match: str | None = None, roots: list[int] | None = None,
                 interval_s: float = 0.25) -> None:
        if not match and not roots:
            raise ValueError("give a command-line pattern or pids to measure")
        self.match, self.roots, self.interval_s = match, roots, interval_s
        self.peak_rss_bytes = 0
        self.peak_pss_bytes = 0
        self.samples = 0
        self.last = StackMemory()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-memory", daemon=True)

    def sample(self) -> StackMemory:
        stack = measure(find_pids(self.match, self.roots))
        self.peak_rss_bytes = max(self.peak_rss_bytes, stack.rss_bytes)
        self.peak_pss_bytes = max(self.peak_pss_bytes, stack.pss_bytes)
        self.samples += 1
        self.last = stack
        return stack

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> "MemorySampler":
        self.sample()  # one reading before returning, so a short run still has one
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()
        return self.report()

    def report(self) -> dict:
        return {
            "samples": self.samples,
            "total_rss_bytes": self.last.rss_bytes,
            "services": by_service(self.last.processes),
            "peak_sum_rss_bytes": self.peak_rss_bytes,
            "peak_sum_pss_bytes": self.peak_pss_bytes,
            "sum_peak_rss_bytes": self.last.sum_peak_rss_bytes,
            "processes": [{"pid": p.pid, "cmd": p.cmd, "rss_bytes": p.rss_bytes,
                           "pss_bytes": p.pss_bytes, "peak_rss_bytes": p.peak_rss_bytes}
                          for p in self.last.processes],
        }


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def gapserve_kv_cache_bytes(grpc_address: str) -> int:
    """The KV cache a gapserve stack allocated, from the frontend's GetModelInfo:
    blocks x block size x layers x (K and V) x KV heads x head dim x dtype size."""
    import grpc

    from shared.proto import common_pb2, generate_pb2_grpc

    with grpc.insecure_channel(grpc_address) as channel:
        reply = generate_pb2_grpc.GenerationStub(channel).GetModelInfo(
            common_pb2.GetModelInfoRequest(), timeout=10.0)
    m = reply.model_info
    dtype = m.dtype.removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {m.dtype!r}")
    return (m.num_kv_blocks * m.block_size * m.num_layers * 2 * m.num_kv_heads
            * m.head_dim * _DTYPE_BYTES[dtype])


def add_kv_share(report: dict, kv_cache_bytes: int) -> dict:
    report["kv_cache_bytes"] = kv_cache_bytes
    peak = report["peak_sum_rss_bytes"]
    report["kv_cache_share_of_peak_rss"] = kv_cache_bytes / peak if peak else None
    return report


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def machine() -> dict:
    """What the numbers were measured on: the CPU's model, core count and the vector
    extensions that pick the C kernels' build (lscpu's flags, filtered)."""
    model = platform.processor() or "?"
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("?", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split()
                         if f.startswith(("avx", "amx", "fma", "f16c"))]
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": model, "cores": os.cpu_count(), "cpu_flags": flags,
            "memory_gib": round(mem / 2**30, 1), "python": platform.python_version()}


READY_LINE = "Ctrl-C stops all services"  # gapserve serve's last line once all are healthy


def _model_info(grpc_address: str):
    import grpc

    from shared.proto import common_pb2, generate_pb2_grpc

    with grpc.insecure_channel(grpc_address) as channel:
        return generate_pb2_grpc.GenerationStub(channel).GetModelInfo(
            common_pb2.GetModelInfoRequest(), timeout=10.0).model_info


def fill_pool_requests(pool_tokens: int, max_model_len: int, vocab_size: int,
                       max_tokens: int = 8) -> list[list[int]]:
    """Prompts of random token ids (each its own seed: no prefix in common, so no block
    is shared) of up to 2048 tokens, one more than the pool holds at once: sent
    together they occupy every block."""
    import random

    length = max(min(max_model_len - max_tokens, 2048), 1)
    count = -(-pool_tokens // (length + max_tokens)) + 1
    return [[random.Random(i).randrange(100, vocab_size) for _ in range(length)]
            for i in range(count)]


def _token_request(http: str, model: str, prompt: list[int], max_tokens: int) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(http + "/v1/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as reply:
        reply.read()


def _one_request(http: str, i: int, max_tokens: int) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": f"Tell story number {i}."}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(http + "/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as reply:
        reply.read()


def _concurrently(target, arg_lists: list[tuple]) -> None:
    threads = [threading.Thread(target=target, args=args) for args in arg_lists]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def serve_and_measure(serve_args: list[str], load: int, max_tokens: int,
                      fill_pool: bool = False) -> dict:
    """Start `gapserve serve` as a child, read each service's RSS once it is ready,
    then after `load` concurrent chat requests; stop it. The worker's KV pages become
    resident as blocks are written, so the two readings differ by what the load used."""
    cmd = [sys.executable, "-m", "gapserve", "serve", *serve_args]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in child.stdout:  # blocks until serve prints its ready banner
            if READY_LINE in line:
                break
        else:
            raise RuntimeError(f"{' '.join(cmd)} exited ({child.wait()}) before it was ready")
        threading.Thread(target=child.stdout.read, daemon=True).start()  # drain the rest
        port = serve_args[serve_args.index("--port") + 1] if "--port" in serve_args \
            else "8000"
        ready = MemorySampler(roots=[child.pid]).start().stop()
        out = {"command": "gapserve serve " + " ".join(serve_args), "at_start": ready}
        http = f"http://127.0.0.1:{port}"
        if load:
            sampler = MemorySampler(roots=[child.pid]).start()
            _concurrently(_one_request, [(http, i, max_tokens) for i in range(load)])
            out["after_load"] = sampler.stop()
            out["load"] = {"requests": load, "max_tokens": max_tokens}
        if fill_pool:
            grpc_port = serve_args[serve_args.index("--grpc-port") + 1] \
                if "--grpc-port" in serve_args else "50051"
            info = _model_info(f"127.0.0.1:{grpc_port}")
            pool_tokens = (info.num_kv_blocks - 1) * info.block_size
            prompts = fill_pool_requests(pool_tokens, info.max_model_len, info.vocab_size)
            sampler = MemorySampler(roots=[child.pid]).start()
            t0 = time.monotonic()
            _concurrently(_token_request, [(http, info.model_name, p, 8) for p in prompts])
            out["pool_full"] = sampler.stop()
            out["fill"] = {"pool_tokens": pool_tokens, "requests": len(prompts),
                           "prompt_tokens": len(prompts[0]), "max_tokens": 8,
                           "seconds": round(time.monotonic() - t0, 1)}
        return out
    finally:
        child.terminate()
        child.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", help="substring of the command lines to measure")
    parser.add_argument("--pid", type=int, action="append", default=[],
                        help="a process to measure with its descendants (repeatable)")
    parser.add_argument("--watch", type=float, default=0.0,
                        help="sample for this many seconds and report the peak")
    parser.add_argument("--gapserve-grpc", metavar="HOST:PORT", default=None,
                        help="a gapserve frontend's gRPC address: also report the KV "
                             "cache's size and its share of the stack's peak RSS")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--serve", action="store_true",
                        help="start `gapserve serve` itself and measure it at start "
                             "(and after --load requests)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="a flag for the started `gapserve serve` (repeatable; "
                             "e.g. --serve-arg=--port --serve-arg=8080)")
    parser.add_argument("--load", type=int, default=0,
                        help="with --serve: this many concurrent chat requests")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--fill-pool", action="store_true",
                        help="with --serve: then fill the KV pool (long concurrent prompts "
                             "of random token ids) and measure again (pool_full)")
    parser.add_argument("--out", help="with --serve: write the record (with the machine) "
                                      "as JSON here, e.g. docs/results/stack_memory-*.json")
    args = parser.parse_args(argv)
    if args.serve:
        record = {"date": time.strftime("%Y-%m-%dT%H:%M+00:00", time.gmtime()),
                  "machine": machine(),
                  **serve_and_measure(args.serve_arg, args.load, args.max_tokens,
                                     args.fill_pool)}
        text = json.dumps(record, indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n")
        for phase in ("at_start", "after_load", "pool_full"):
            if phase in record:
                parts = ", ".join(f"{k} {_mib(v)}" for k, v in record[phase]["services"].items())
                print(f"{phase}: total {_mib(record[phase]['total_rss_bytes'])} ({parts}); "
                      f"peak summed RSS {_mib(record[phase]['peak_sum_rss_bytes'])}")
        return 0
    if not args.match and not args.pid:
        parser.error("give --match or --pid")
    sampler = MemorySampler(args.match, args.pid).start()
    time.sleep(args.watch)  # a CLI waiting for wall time, not synchronisation
    report = sampler.stop()
    if not report["processes"]:
        parser.exit(1, "no matching process\n")
    if args.gapserve_grpc:
        add_kv_share(report, gapserve_kv_cache_bytes(args.gapserve_grpc))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for p in report["processes"]:
        print(f"{p['pid']:>8}  rss {_mib(p['rss_bytes']):>10}  pss {_mib(p['pss_bytes']):>10}"
              f"  peak {_mib(p['peak_rss_bytes']):>10}  {p['cmd']}")
    print("by service: " + ", ".join(f"{k} {_mib(v)}" for k, v in report["services"].items())
          + f"; total {_mib(report['total_rss_bytes'])}")
    print(f"stack: peak summed RSS {_mib(report['peak_sum_rss_bytes'])}, "
          f"peak summed PSS {_mib(report['peak_sum_pss_bytes'])}, "
          f"sum of per-process peaks {_mib(report['sum_peak_rss_bytes'])}")
    if "kv_cache_bytes" in report:
        print(f"KV cache: {_mib(report['kv_cache_bytes'])}, "
              f"{100 * report['kv_cache_share_of_peak_rss']:.0f}% of the peak summed RSS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
