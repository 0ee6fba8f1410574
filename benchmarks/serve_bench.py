"""Serving benchmark for any OpenAI-compatible endpoint (gapserve, vLLM, llama-server).

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000/v1 \\
        --workload essay --num-requests 64 --concurrency 64 --max-tokens 128 \\
        --ignore-eos --temperature 0

Sends a fixed number of streaming requests, either with at most `--concurrency` in
flight or arriving as a Poisson process at `--request-rate` per second, and reports
output tokens/s, requests/s, time to first token (TTFT), inter-token latency (ITL,
the gap between streamed chunks), end-to-end latency and errors: a table on stdout,
or JSON with `--json`. Progress goes to stderr while it runs.

Prompts: `--workload essay` ("Write an extremely detailed essay about the number
{i}." through the chat endpoint, so the server applies its chat template),
`--workload random` (random common words, `--input-len 64` or a range `32:256`; a
common English word is one token in the usual BPE vocabularies, so lengths are
close to token counts, and the server's own prompt-token count is reported), or
`--prompt-file` (a JSON list of strings, or of objects with "prompt" or "messages"
and optionally "max_tokens"). `--ignore-eos` sends `ignore_eos: true` in the body,
the extension vLLM and llama-server accept; output token counts come from the
server's usage report (`stream_options.include_usage`) where it sends one.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ESSAY_PROMPT = "Write an extremely detailed essay about the number {i}."
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from "
    "at which but have an they you were her she there one all we their has been would "
    "when who will more no if out so said what up its about into than them can only "
    "other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three"
).split()


@dataclass(slots=True)
class BenchRequest:
    messages: list[dict] | None  # chat endpoint
    prompt: str | None  # completions endpoint
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    latency_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    chunks: int = 0  # streamed chunks that carried text
    output_tokens: int = 0
    prompt_tokens: int | None = None


# ---------------------------------------------------------------- prompts


def _parse_len(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if lo < 1 or hi < lo:
        raise ValueError(f"--input-len must be N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The benchmark's requests, deterministic for a given --seed."""
    rng = random.Random(args.seed)
    chat = args.endpoint == "chat"

    def make(text: str | None, messages: list[dict] | None, max_tokens: int) -> BenchRequest:
        if chat:
            return BenchRequest(messages or [{"role": "user", "content": text}], None, max_tokens)
        if text is None:
            raise ValueError("the completions endpoint needs prompts, not chat messages")
        return BenchRequest(None, text, max_tokens)

    if args.prompt_file:
        items = json.loads(Path(args.prompt_file).read_text())
        if not isinstance(items, list) or not items:
            raise ValueError(f"{args.prompt_file}: expected a non-empty JSON list")
        out = []
        for i in range(args.num_requests):
            item = items[i % len(items)]
            if isinstance(item, str):
                item = {"prompt": item}
            if not isinstance(item, dict) or not ("prompt" in item or "messages" in item):
                raise ValueError(f"{args.prompt_file}: item {i % len(items)} needs "
                                 "'prompt' or 'messages'")
            out.append(make(item.get("prompt"), item.get("messages"),
                            int(item.get("max_tokens", args.max_tokens))))
        return out
    if args.workload == "essay":
        return [make(ESSAY_PROMPT.format(i=i), None, args.max_tokens)
                for i in range(args.num_requests)]
    lo, hi = _parse_len(args.input_len)
    return [make(" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))), None,
                 args.max_tokens) for _ in range(args.num_requests)]


def request_body(req: BenchRequest, args: argparse.Namespace) -> dict:
    body: dict = {"model": args.model, "max_tokens": req.max_tokens, "stream": args.stream,
                  "temperature": args.temperature}
    if req.messages is not None:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.seed_requests:
        body["seed"] = args.seed
    return body


# ---------------------------------------------------------------- one request


def _chunk_text(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """One request, timed from just before sending to the end of the stream."""
    res = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                return res
            if not body["stream"]:
                data = json.loads(await resp.aread())
                now = time.perf_counter()
                res.ttft_s = now - start
                texts = [c.get("text") or (c.get("message") or {}).get("content") or ""
                         for c in data["choices"]]
                res.chunks = 1 if any(texts) else 0
                _take_usage(res, data.get("usage"))
                res.ok = True
                return res
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    res.error = f"in-stream error: {json.dumps(data['error'])[:200]}"
                    return res
                now = time.perf_counter()
                if any(_chunk_text(c) for c in data.get("choices") or []):
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.itls_s.append(now - last)
                    last = now
                    res.chunks += 1
                _take_usage(res, data.get("usage"))
            if not done:
                res.error = "stream ended without [DONE]"
                return res
            res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        res.latency_s = time.perf_counter() - start
        if res.output_tokens == 0:
            res.output_tokens = res.chunks  # no usage report: one token per chunk
    return res


def _take_usage(res: RequestResult, usage: dict | None) -> None:
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens") is not None:
            res.prompt_tokens = int(usage["prompt_tokens"])


# ---------------------------------------------------------------- the run


class Progress:
    """One status line on stderr: rewritten in place on a terminal, else a line per
    tenth of the run, so logs of a CI run stay short."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.done = self.errors = self.tokens = 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.step = max(1, total // 10)

    def update(self, res: RequestResult) -> None:
        self.done += 1
        self.errors += not res.ok
        self.tokens += res.output_tokens
        if self.quiet or not (self.tty or self.done % self.step == 0 or self.done == self.total):
            return
        elapsed = time.perf_counter() - self.start
        line = (f"[serve_bench] {self.done}/{self.total} done, {self.errors} errors, "
                f"{elapsed:.1f} s, {self.tokens / max(elapsed, 1e-9):.1f} output tok/s")
        sys.stderr.write(("\r" + line + ("\n" if self.done == self.total else ""))
                         if self.tty else line + "\n")
        sys.stderr.flush()


async def run(args: argparse.Namespace, requests: list[BenchRequest],
              transport: httpx.AsyncBaseTransport | None = None,
              ) -> tuple[list[RequestResult], float]:
    """Sends the requests; returns their results in order and the wall time."""
    url = args.base_url.rstrip("/") + ("/chat/completions" if args.endpoint == "chat"
                                       else "/completions")
    limit = args.concurrency or len(requests)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    gate = asyncio.Semaphore(limit)
    rng = random.Random(args.seed + 1)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers,
                                 transport=transport) as client:
        for req in requests[:args.warmup]:  # untimed: first-call costs are not serving costs
            res = await send(client, url, request_body(req, args))
            if not res.ok:  # a server that is not ready would make every figure wrong
                raise RuntimeError(f"warm-up request failed: {res.error}")
        progress = Progress(len(requests), args.quiet)

        async def one(req: BenchRequest) -> RequestResult:
            async with gate:
                res = await send(client, url, request_body(req, args))
            progress.update(res)
            return res

        if not args.quiet:
            how = (f"Poisson arrivals at {args.request_rate}/s" if args.request_rate
                   else f"concurrency {limit}")
            print(f"[serve_bench] {len(requests)} requests to {url}, {how}", file=sys.stderr)
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))  # the arrival process
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


# ---------------------------------------------------------------- the report


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _summary_ms(values_s: list[float]) -> dict:
    """mean/p50/p99 in ms; None where nothing was measured (JSON has no NaN)."""
    ms = [v * 1000.0 for v in values_s]
    if not ms:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": sum(ms) / len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99)}


def summarize(results: list[RequestResult], duration_s: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1)
            for r in ok if r.ttft_s is not None and r.output_tokens > 1]
    return {
        "base_url": args.base_url,
        "model": args.model,
        "endpoint": args.endpoint,
        "workload": "file" if args.prompt_file else args.workload,
        "started_at": args.started_at,
        "num_requests": len(results),
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "stream": args.stream,
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_output_tokens": out_tokens,
        "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else None,
        "ttft_ms": _summary_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _summary_ms([gap for r in ok for gap in r.itls_s]),
        "tpot_ms": _summary_ms(tpot),
        "e2e_latency_ms": _summary_ms([r.latency_s for r in ok]),
    }


def format_table(report: dict) -> str:
    def ms(key: str) -> list[tuple[str, str]]:
        s = report[key]
        name = key.removesuffix("_ms").replace("_", " ").upper().replace("E2E LATENCY",
                                                                          "E2E latency")
        cells = ["-" if s[k] is None else f"{s[k]:.1f}" for k in ("mean", "p50", "p99")]
        return [(f"{name} mean / p50 / p99 (ms)", " / ".join(cells))]

    mode = (f"Poisson {report['request_rate']}/s" if report["request_rate"]
            else f"concurrency {report['concurrency'] or report['num_requests']}")
    rows = [
        ("Endpoint", f"{report['base_url']} ({report['endpoint']}, {report['model']})"),
        ("Workload", f"{report['workload']}, {report['num_requests']} requests, {mode}, "
                     f"max_tokens {report['max_tokens']}"
                     + (", ignore_eos" if report["ignore_eos"] else "")),
        ("Completed / errors", f"{report['completed']} / {report['errors']}"),
        ("Duration (s)", f"{report['duration_s']:.2f}"),
        ("Output tokens/s", f"{report['output_throughput']:.1f}"),
        ("Requests/s", f"{report['request_throughput']:.2f}"),
        ("Total output tokens", str(report["total_output_tokens"])),
    ]
    if report["mean_prompt_tokens"] is not None:
        rows.append(("Mean prompt tokens", f"{report['mean_prompt_tokens']:.1f}"))
    rows += ms("ttft_ms") + ms("itl_ms") + ms("tpot_ms") + ms("e2e_latency_ms")
    mem = report.get("memory")
    if mem:
        rows.append(("Stack peak RSS / PSS (MiB)",
                     f"{mem['peak_sum_rss_bytes'] / 2**20:.0f} / "
                     f"{mem['peak_sum_pss_bytes'] / 2**20:.0f}"))
        if mem.get("kv_cache_bytes") is not None:
            rows.append(("KV cache (MiB, share of peak RSS)",
                         f"{mem['kv_cache_bytes'] / 2**20:.0f} "
                         f"({100 * mem['kv_cache_share_of_peak_rss']:.0f}%)"))
    rows += [("Error", e) for e in report["error_samples"]]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="the server's OpenAI API root, ending in /v1")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first of the server's /models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=None,
                   help="most requests in flight (default: all at once)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals per second instead of sending all at once")
    p.add_argument("--workload", choices=("essay", "random"), default="essay")
    p.add_argument("--input-len", default="64", help="random workload: words, N or LOW:HIGH")
    p.add_argument("--prompt-file", default=None, help="JSON list of prompts (see above)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM / llama-server extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="for random prompts and arrivals")
    p.add_argument("--seed-requests", action="store_true", help="also send seed per request")
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--warmup", type=int, default=0, help="untimed requests sent first")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--memory-match", default=None,
                   help="also sample the summed memory of processes whose command line "
                        "contains this (see stack_memory.py)")
    p.add_argument("--memory-pid", type=int, action="append", default=[],
                   help="a stack process to measure with its descendants (repeatable)")
    p.add_argument("--kv-from-gapserve", metavar="HOST:PORT", default=None,
                   help="with --memory-*: a gapserve frontend's gRPC address, to report "
                        "the KV cache's size and share of the peak memory")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH, or to stdout instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    for name in ("num_requests", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    if args.request_rate is not None and not (args.request_rate > 0 and
                                              math.isfinite(args.request_rate)):
        p.error("--request-rate must be a positive number")
    if args.warmup < 0 or args.timeout <= 0:
        p.error("--warmup must be >= 0 and --timeout > 0")
    try:
        _parse_len(args.input_len)
    except ValueError as exc:
        p.error(str(exc))
    return args


def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        requests = build_requests(args)
        args.model = args.model or first_model(args.base_url, args.api_key)
    except (ValueError, OSError, httpx.HTTPError, KeyError, IndexError) as exc:
        print(f"serve_bench: {exc}", file=sys.stderr)
        return 2
    args.started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    sampler = kv_bytes = None
    if args.memory_match or args.memory_pid:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import stack_memory
        if args.kv_from_gapserve:  # asked first: a wrong address fails before the run
            try:
                kv_bytes = stack_memory.gapserve_kv_cache_bytes(args.kv_from_gapserve)
            except Exception as exc:  # grpc.RpcError, ValueError: report and stop
                print(f"serve_bench: KV cache size from {args.kv_from_gapserve}: {exc}",
                      file=sys.stderr)
                return 2
        sampler = stack_memory.MemorySampler(args.memory_match, args.memory_pid).start()
    try:
        results, duration = asyncio.run(run(args, requests))
    except RuntimeError as exc:
        print(f"serve_bench: {exc}", file=sys.stderr)
        return 2
    report = summarize(results, duration, args)
    if sampler is not None:
        report["memory"] = sampler.stop()
        if kv_bytes is not None:
            stack_memory.add_kv_share(report["memory"], kv_bytes)
    if args.json and args.json != "-":
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0 if report["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
