"""Data parallelism on a shared-prefix chat workload: two replicas of the default
model behind three routings, in one run.

    python benchmarks/data_parallel.py [--repeats 3] [--users 32] [--turns 2]
        [--system-prompts 4] [--system-words 400] [--kv-blocks 96] [--json out.json]

Modes (each on two replicas, started fresh for every run so every cache is cold):

- `round-robin`: `gapserve serve --data-parallel-size 2 --data-parallel-routing
  round-robin`, one frontend, two scheduler + worker groups, requests dealt in turn;
- `kv-aware`: the same with `--data-parallel-routing kv-aware` (the frontend routes
  by the replicas' KV events, docs/deploy.md);
- `sglang-router`: two full `gapserve serve` stacks (a frontend each) behind
  sglang-router's cache_aware policy with its own defaults (the installed version's
  `RouterArgs`: 0.3 / 64 / 1.5 for 0.3.2), passed explicitly; the built-in routing
  runs with the same three thresholds, so the rules, not their settings, differ.

The workload: --users users, each bound to one of a few long system prompts
(--system-prompts, --system-words words each), each holding a --turns-turn chat
(short user turns; the history grows by its own replies), at most --concurrency
users in flight, greedy, --max-tokens tokens a reply (EOS ignored, so every mode
does the same work). Each replica's KV pool is --kv-blocks blocks of --block-size
tokens. The report states the condition the run shows: the system prompts' full
blocks (the part a prefix cache can share, counted with the model's tokenizer) over
one replica's pool. Near or under 1x, one replica can hold every prompt and every
routing converges to the same hit rate; between 1x and 2x (e.g. --kv-blocks 69 for
the default 4 prompts of 400 words, 104 blocks: 1.5x), the prompts fit in the two
pools together but not in one, the case cache-aware routing exists for.

Reported per mode, the median over --repeats runs and the spread (min-max): the
prefix-cache hit rate (vllm:prefix_cache_hits / vllm:prefix_cache_queries, the
deltas on the frontends' /metrics), output tokens/s per core (every process of the
run and this client share the machine's cores: stated in the table), TTFT p50/p99
(first content chunk, client side), and per run the requests each replica served
(placement explains most of the rest). The modes alternate over the repeats (repeat r
starts at mode r), so a slow spell of a shared machine does not fall on one mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODES = ("round-robin", "sglang-router", "kv-aware")
GOAL = "kv-aware: hit rate >= sglang-router's and >= 1.5x round-robin's; TTFT p50 below both"
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name").split()
PORT_SPAN = 260  # a deployment's ports: http +0, grpc +51, scheduler +52, worker +53, x2


# ---------------------------------------------------------------- the workload


@dataclass(slots=True)
class User:
    system: str
    turns: list[str]


def workload(args: argparse.Namespace) -> list[User]:
    """The same users every run (seeded): user u is bound to system prompt u % P."""
    rng = random.Random(args.seed)
    systems = [f"You are assistant number {p} of a large support team. " +
               " ".join(rng.choice(WORDS) for _ in range(args.system_words))
               for p in range(args.system_prompts)]
    users = []
    for u in range(args.users):
        turns = [f"User {u}, question {t}: what about the " +
                 " ".join(rng.choice(WORDS) for _ in range(6)) + "?" for t in range(args.turns)]
        users.append(User(systems[u % len(systems)], turns))
    rng.shuffle(users)  # users of one system prompt do not arrive together
    return users


@dataclass(slots=True)
class Outcome:
    ttfts_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: list[str] = field(default_factory=list)


async def one_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict],
                   max_tokens: int, out: Outcome) -> str:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, text = time.perf_counter(), None, []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            out.errors.append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
            return ""
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                out.output_tokens += event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    if first is None:
        out.errors.append("no content")
    else:
        out.ttfts_s.append(first - start)
    return "".join(text)


async def drive(url: str, model: str, users: list[User], args: argparse.Namespace) -> Outcome:
    """Every user's chat, at most --concurrency users at once; returns client-side
    timings (wall time is the caller's)."""
    out, gate = Outcome(), asyncio.Semaphore(args.concurrency)

    async def chat(user: User, client: httpx.AsyncClient) -> None:
        async with gate:
            messages = [{"role": "system", "content": user.system}]
            for turn in user.turns:
                messages.append({"role": "user", "content": turn})
                try:
                    reply = await one_turn(client, url, model, messages, args.max_tokens, out)
                except httpx.HTTPError as exc:
                    out.errors.append(repr(exc))
                    return
                messages.append({"role": "assistant", "content": reply})

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(chat(u, client) for u in users))
    return out


# ---------------------------------------------------------------- the deployments


def free_port_block(span: int = PORT_SPAN) -> int:
    """A base port whose deployment ports (+0, +51..+53 and the second replica's
    +100 stride) are free."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span > 65535:
            continue
        try:
            for off in (0, 51, 52, 53, 100, 151, 152, 153):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_thresholds() -> dict[str, float]:
    """sglang-router's own defaults for cache_aware, as the installed version's CLI
    has them (its `--help`); given to it explicitly and to the built-in routing."""
    from sglang_router.router_args import RouterArgs
    d = RouterArgs()
    return {"cache_threshold": d.cache_threshold,
            "balance_abs_threshold": d.balance_abs_threshold,
            "balance_rel_threshold": d.balance_rel_threshold}


def serve_argv(args: argparse.Namespace, base: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "gapserve", "serve", "--model", args.model,
            "--http-port", str(base), "--grpc-port", str(base + 51),
            "--scheduler-port", str(base + 52), "--worker-port", str(base + 53),
            "--scheduler-metrics-port", "0", "--worker-metrics-port", "0",
            "--max-model-len", str(args.max_model_len),
            "--num-gpu-blocks-override", str(args.kv_blocks), "--block-size",
            str(args.block_size), "--log-level", os.environ.get("DP_BENCH_LOG_LEVEL", "warning"),
            *extra]


@dataclass(slots=True)
class Deployment:
    """The processes of one run, where clients go and the frontends to scrape."""
    url: str
    frontends: list[str]
    procs: list[subprocess.Popen]

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the router first, then the stacks
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1"}
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)


def wait_until(what: str, check, procs: list[subprocess.Popen], timeout_s: float,
               log_dir: Path) -> None:
    """Poll check() until it holds; fail at once if a process died."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {'a process exited' if dead else 'timed out'}; "
                               f"logs in {log_dir}")
        time.sleep(0.5)


def ready(url: str) -> bool:
    return httpx.get(url + "/ready", timeout=5).status_code == 200


def start(mode: str, args: argparse.Namespace, log_dir: Path) -> Deployment:
    t = router_thresholds()
    if mode in ("round-robin", "kv-aware"):
        base = free_port_block()
        proc = spawn(serve_argv(args, base, [
            "--data-parallel-size", "2", "--data-parallel-routing", mode,
            "--routing-cache-threshold", str(t["cache_threshold"]),
            "--routing-balance-abs-threshold", str(t["balance_abs_threshold"]),
            "--routing-balance-rel-threshold", str(t["balance_rel_threshold"])]),
            log_dir / f"{mode}.log")
        url = f"http://127.0.0.1:{base}"
        dep = Deployment(url, [url], [proc])
        wait_until(f"{mode} ready", lambda: ready(url), dep.procs, args.start_timeout_s, log_dir)
        return dep
    bases = [free_port_block(), None]
    procs = [spawn(serve_argv(args, bases[0], []), log_dir / "sglang-replica-0.log")]
    while bases[1] is None or abs(bases[1] - bases[0]) < PORT_SPAN:
        bases[1] = free_port_block()
    procs.append(spawn(serve_argv(args, bases[1], []), log_dir / "sglang-replica-1.log"))
    fronts = [f"http://127.0.0.1:{b}" for b in bases]
    dep = Deployment("", fronts, procs)
    try:
        wait_until("replicas ready", lambda: all(ready(u) for u in fronts), procs,
                   args.start_timeout_s, log_dir)
        port = free_port()
        procs.append(spawn([sys.executable, "-m", "sglang_router.launch_router",
                            "--worker-urls", *fronts, "--policy", "cache_aware",
                            "--cache-threshold", str(t["cache_threshold"]),
                            "--balance-abs-threshold", str(t["balance_abs_threshold"]),
                            "--balance-rel-threshold", str(t["balance_rel_threshold"]),
                            "--host", "127.0.0.1", "--port", str(port),
                            "--prometheus-host", "127.0.0.1",
                            "--prometheus-port", str(free_port()), "--log-level", "warn"],
                           log_dir / "sglang-router.log"))
        dep.url = f"http://127.0.0.1:{port}"

        def registered() -> bool:
            workers = httpx.get(dep.url + "/workers", timeout=5).json()["workers"]
            return len(workers) == 2 and all(w["is_healthy"] for w in workers)
        wait_until("sglang-router registered both", registered, procs, 60, log_dir)
    except BaseException:
        dep.stop()
        raise
    return dep


def counters(frontends: list[str]) -> dict[str, float]:
    """vllm:prefix_cache_{hits,queries} summed over the frontends' /metrics."""
    out = {"hits": 0.0, "queries": 0.0}
    for url in frontends:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == "vllm:prefix_cache_hits_total":
                out["hits"] += float(line.rsplit(" ", 1)[1])
            elif name == "vllm:prefix_cache_queries_total":
                out["queries"] += float(line.rsplit(" ", 1)[1])
    return out


def split(dep: Deployment, mode: str) -> list[int]:
    """Requests each replica served: the built-in routing's own count per replica
    (/v1/status), or each frontend's finished requests behind sglang-router."""
    if mode == "sglang-router":
        out = []
        for url in dep.frontends:
            text = httpx.get(url + "/metrics", timeout=10).text
            out.append(int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                               if line.startswith("vllm:request_success_total"))))
        return out
    status = httpx.get(dep.url + "/v1/status", timeout=10).json()
    return [row["routed"] for row in status["replicas"]]


def reasons(dep: Deployment, mode: str) -> dict[str, int]:
    """The built-in routing's decisions by reason (gapserve:requests_routed_total)."""
    if mode == "sglang-router":
        return {}
    out: dict[str, int] = {}
    for line in httpx.get(dep.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("gapserve:requests_routed_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def run_once(mode: str, args: argparse.Namespace, users: list[User], log_dir: Path) -> dict:
    dep = start(mode, args, log_dir)
    try:
        model = served_model(dep.url)
        before = counters(dep.frontends)
        t0 = time.perf_counter()
        out = asyncio.run(drive(dep.url, model, users, args))
        wall = time.perf_counter() - t0
        loadavg = os.getloadavg()  # the machine's 1-minute load at the run's end
        after = counters(dep.frontends)
        per_replica = split(dep, mode)
        by_reason = reasons(dep, mode)
    finally:
        dep.stop()
    queries = after["queries"] - before["queries"]
    ttfts = sorted(out.ttfts_s)
    hits = after["hits"] - before["hits"]
    return {"mode": mode, "wall_s": wall, "requests": len(ttfts), "errors": out.errors[:5],
            "num_errors": len(out.errors), "per_replica": per_replica, "reasons": by_reason,
            "hit_rate": hits / queries if queries else 0.0, "output_tokens": out.output_tokens,
            "tok_s_per_core": out.output_tokens / wall / args.cores,
            "ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p99_ms": 1000 * percentile(ttfts, 99), "loadavg": loadavg}


# ---------------------------------------------------------------- the report


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (the value a q% of samples are at or below)."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, -(-len(sorted_values) * q // 100) - 1))
    return sorted_values[int(k)]


def order(repeat: int, modes: list[str]) -> list[str]:
    """Repeat r starts at mode r: each mode runs first, middle and last in turn."""
    k = repeat % len(modes)
    return modes[k:] + modes[:k]


KEYS = ("hit_rate", "tok_s_per_core", "ttft_p50_ms", "ttft_p99_ms")


def summarize(runs: list[dict], modes: list[str]) -> dict[str, dict]:
    out = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {k: {"median": statistics.median(r[k] for r in mine),
                         "min": min(r[k] for r in mine), "max": max(r[k] for r in mine)}
                     for k in KEYS}
        out[mode]["runs"] = len(mine)
        out[mode]["errors"] = sum(r["num_errors"] for r in mine)
        out[mode]["splits"] = ["/".join(map(str, r.get("per_replica", []))) for r in mine]
    return out


def goal(summary: dict[str, dict]) -> list[str]:
    """The issue's goal, each part checked on the medians (only where its modes ran)."""
    lines = []
    kv = summary.get("kv-aware")
    if kv is None:
        return ["goal not checked: kv-aware did not run"]
    med = lambda mode, key: summary[mode][key]["median"]  # noqa: E731
    if "sglang-router" in summary:
        lines.append(f"kv-aware hit rate >= sglang-router's: "
                     f"{med('kv-aware', 'hit_rate') >= med('sglang-router', 'hit_rate')}")
    if "round-robin" in summary:
        lines.append(f"kv-aware hit rate >= 1.5x round-robin's: "
                     f"{med('kv-aware', 'hit_rate') >= 1.5 * med('round-robin', 'hit_rate')}")
    others = [m for m in summary if m != "kv-aware"]
    if others:
        lines.append(f"kv-aware TTFT p50 below {' and '.join(others)}: " + str(all(
            med("kv-aware", "ttft_p50_ms") < med(m, "ttft_p50_ms") for m in others)))
    return lines


def prompt_blocks(args: argparse.Namespace, users: list[User]) -> int | None:
    """Full KV blocks of all distinct system prompts (their chat-template prefix as
    the frontend tokenizes it): what the prefix caches of the replicas compete for.
    None where the model has no tokenizer to count with."""
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
    except (ImportError, OSError, ValueError):
        return None
    total = 0
    for system in sorted({u.system for u in users}):
        ids = tok.apply_chat_template([{"role": "system", "content": system}], tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        total += len(ids) // args.block_size
    return total


def condition(args: argparse.Namespace) -> str:
    """The sentence saying which case the run shows (pool against the prompts)."""
    blocks = getattr(args, "prompt_blocks", None)
    if blocks is None:
        return "system prompts' blocks not counted (no tokenizer)."
    ratio = blocks / args.kv_blocks
    case = ("one replica's pool holds them all: every routing can converge" if ratio <= 1.0
            else "they exceed one replica's pool but fit in two" if ratio <= 2.0
            else "they exceed both pools together")
    return (f"The system prompts fill {blocks} KV blocks, {ratio:.2f}x one replica's "
            f"{args.kv_blocks}: {case}.")


def markdown(summary: dict[str, dict], args: argparse.Namespace) -> str:
    def cell(v: dict, fmt: str) -> str:
        return f"{v['median']:{fmt}} ({v['min']:{fmt}}-{v['max']:{fmt}})"
    rows = ["| routing | prefix-cache hit rate | output tok/s per core | TTFT p50 ms | "
            "TTFT p99 ms | requests per replica, each run | errors |",
            "|---|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        rows.append(f"| {mode} | {cell(s['hit_rate'], '.3f')} | "
                    f"{cell(s['tok_s_per_core'], '.1f')} | {cell(s['ttft_p50_ms'], '.0f')} | "
                    f"{cell(s['ttft_p99_ms'], '.0f')} | {', '.join(s['splits'])} | "
                    f"{s['errors']} |")
    t = getattr(args, "thresholds", None) or router_thresholds()
    rows.append("")
    rows.append(f"Medians (min-max) over {args.repeats} alternating runs; two replicas and this "
                f"client share {args.cores} cores (tok/s is divided by {args.cores}). "
                f"{args.users} users x {args.turns} turns, {args.system_prompts} system prompts "
                f"of {args.system_words} words, {args.max_tokens} tokens a reply, "
                f"{args.concurrency} users in flight, {args.kv_blocks} KV blocks of "
                f"{args.block_size} tokens a replica. sglang-router and the built-in routing "
                f"both with cache threshold {t['cache_threshold']}, balance "
                f"thresholds {t['balance_abs_threshold']} and "
                f"{t['balance_rel_threshold']}x (sglang-router's own "
                f"defaults). {condition(args)}")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the default model)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-words", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=96,
                   help="KV blocks of each replica (its pool; see the module docstring for "
                        "choosing it against the system prompts)")
    p.add_argument("--block-size", type=int, default=16, help="tokens a KV block")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--log-dir", default=None, help="process logs (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write every run and the summary here")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    for name in ("repeats", "users", "turns", "system_prompts", "system_words", "max_tokens",
                 "concurrency", "kv_blocks", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.cores = len(os.sched_getaffinity(0))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from shared.model_files.default_model import ensure_default_model
        args.model = str(ensure_default_model())
    import tempfile
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gapserve-dp-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    users, runs = workload(args), []
    args.prompt_blocks = prompt_blocks(args, users)
    args.thresholds = router_thresholds()
    print(condition(args), file=sys.stderr, flush=True)
    for repeat in range(args.repeats):
        for mode in order(repeat, args.modes):
            run = run_once(mode, args, users, log_dir)
            runs.append({**run, "repeat": repeat})
            print(f"repeat {repeat} {mode}: hit rate {run['hit_rate']:.3f}, "
                  f"{run['tok_s_per_core']:.1f} tok/s/core, TTFT p50 {run['ttft_p50_ms']:.0f} "
                  f"ms p99 {run['ttft_p99_ms']:.0f} ms, per replica {run['per_replica']}, "
                  f"reasons {run['reasons']}, "
                  f"{run['num_errors']} errors, "
                  f"{run['wall_s']:.1f} s, load {run['loadavg'][0]:.2f}", file=sys.stderr,
                  flush=True)
    summary = summarize(runs, args.modes)
    print(markdown(summary, args))
    for line in goal(summary):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary,
                                               "goal": goal(summary),
                                               "thresholds": args.thresholds,
                                               "condition": condition(args)}, indent=1))
    return 1 if any(r["num_errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
