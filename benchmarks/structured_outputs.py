"""Structured outputs, measured: throughput and TTFT of json_schema-constrained streams
against unconstrained ones at 1 / 16 / 64 concurrent, in one run on one stack, and the
backend's compile and mask times (llguidance, and xgrammar beside it when installed).

    python benchmarks/structured_outputs.py [--model DIR] [--concurrency 1,16,64]
        [--max-tokens 64] [--compiles 40] [--rounds 2] [--json out.json]
    python benchmarks/structured_outputs.py --overlap [--overlap-requests 16]

--overlap measures instead what docs/async.md reports: one real worker process driven
by the scheduler's own Engine (benchmarks/async_overlap.py's harness), async and sync
scheduling, unconstrained and regex-constrained requests of the same length (a regex
of exactly 400 characters, so none ends early), with the worker's idle time between
steps and its mask time per step.

Starts `gapserve serve` (the default model unless --model) on free ports and talks to
it with gRPC Generate (the frontend's client API: tokenizing, detokenizing and the
compile at the door included; HTTP shapes add nothing the engine does). Each point
runs `concurrency` streams at once (at least 4 requests for the point of 1, one
after another), greedy, chat prompts; unconstrained ones ignore EOS and run
--max-tokens tokens, constrained ones end where the grammar does. Output tokens/s is
tokens over the point's wall time; each point runs --rounds times, unconstrained and
json_schema alternating within a round (so a slow spell of a shared machine falls on
both), and the table gives the median and the spread (min-max) over the rounds, the
ratio of the medians and the spread of the per-round ratios. Beside each point, the
worker's own step timings from its /metrics (deltas of rank 0's histograms over the
point): forward ms and sample ms a step, where sample includes the grammar mask, so
json's sample minus unconstrained's is what the mask costs a step.
Constrained requests share one schema, so after
the first the frontend's and rank 0's compiled-grammar caches hit: the compile cost
is reported apart, from --compiles distinct schemas compiled in this process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.wire.common import sampling_to_proto  # noqa: E402
from shared.structured import compile_cache as so  # noqa: E402
from shared.structured.spec import StructuredOutputSpec  # noqa: E402
from shared.grpc_server import check_health  # noqa: E402
from shared.proto import generate_pb2, generate_pb2_grpc  # noqa: E402
from shared.types import SamplingParams  # noqa: E402

# The lead's measuring schema: nested, 4 properties, enum, pattern and bounds.
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "color", "address"],
          "properties": {
              "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "color": {"enum": ["red", "green", "blue"]},
              "address": {"type": "object", "additionalProperties": False,
                          "required": ["city", "zip"],
                          "properties": {"city": {"type": "string", "maxLength": 24},
                                         "zip": {"type": "string",
                                                 "pattern": "^[0-9]{5}$"}}}}}
QUESTIONS = ["Describe a person as JSON.", "Invent a customer record in JSON.",
             "Give me a JSON profile of a painter.", "A JSON object for a pilot, please."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stack(model: str | None, log_path: Path) -> tuple[subprocess.Popen, str]:
    http, grpc_port, sched, worker, worker_metrics = (free_port() for _ in range(5))
    argv = [sys.executable, "-m", "gapserve", "serve", "--http-port", str(http),
            "--grpc-port", str(grpc_port), "--scheduler-port", str(sched),
            "--worker-port", str(worker), "--scheduler-metrics-port", "0",
            "--worker-metrics-port", str(worker_metrics), "--max-model-len", "1024"]
    if model:
        argv += ["--model", model]
    proc = subprocess.Popen(argv, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    address = f"127.0.0.1:{grpc_port}"
    deadline = time.monotonic() + 300
    while not check_health(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the stack did not start; see {log_path}")
        time.sleep(0.5)
    global WORKER_METRICS_URL, STACK_PID
    STACK_PID = proc.pid
    WORKER_METRICS_URL = f"http://127.0.0.1:{worker_metrics}/metrics"
    return proc, address


WORKER_METRICS_URL = ""
STEP_HISTOGRAMS = {"forward": "gapserve:model_forward_time_milliseconds",
                   "sample": "gapserve:worker_sample_time_milliseconds",
                   "execute": "gapserve:model_execute_time_milliseconds"}


def worker_sums() -> dict[str, float]:
    """Rank 0's step histograms' _sum and _count (read before and after a point)."""
    import urllib.request
    text = urllib.request.urlopen(WORKER_METRICS_URL, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, metric in STEP_HISTOGRAMS.items():
            if name in (metric + "_sum", metric + "_count"):
                out[key + name[len(metric):]] = out.get(key + name[len(metric):], 0.0) + \
                    float(line.rsplit(" ", 1)[1])
    return out


ROLES = ("frontend", "scheduler", "worker")
STACK_PID = 0


def role_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) so far of the stack's processes by role, and of
    this client: which of them a constrained point costs more, on a shared machine."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(ROLES, 0.0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) != STACK_PID:  # ppid: `gapserve serve`'s children only
            continue
        role = next((r for r in ROLES if r.encode() in argv[:4]), None)
        if role:
            out[role] += (int(stat[11]) + int(stat[12])) / tick
    t = os.times()
    out["client"] = t.user + t.system
    return out


def one_stream(stub, prompt_ids: list[int], constrained: bool, max_tokens: int) -> dict:
    spec = StructuredOutputSpec("json", json.dumps(SCHEMA)) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained,
                            structured_output=spec)
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt_ids),
                                           sampling_params=sampling_to_proto(params))
    start, first, tokens, text, stopped = time.monotonic(), None, 0, "", False
    for msg in stub.Generate(request, timeout=600):
        if msg.token_ids and first is None:
            first = time.monotonic()
        tokens += len(msg.token_ids)
        text += msg.text
        stopped = msg.HasField("final") and msg.final.finish_reason == 1  # STOP
    if constrained and stopped:
        json.loads(text)  # the grammar ended it: it parses
    return {"ttft_s": (first or time.monotonic()) - start, "tokens": tokens,
            "stopped": stopped}


def run_point(stub, prompts: list[list[int]], concurrency: int, constrained: bool,
              max_tokens: int) -> dict:
    n = max(concurrency, 4)
    jobs = [prompts[i % len(prompts)] for i in range(n)]
    before, cpu0 = worker_sums(), role_cpu_s()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_stream(stub, p, constrained, max_tokens), jobs))
    wall = time.monotonic() - t0
    after, cpu1 = worker_sums(), role_cpu_s()
    steps = max(1.0, after.get("execute_count", 0) - before.get("execute_count", 0))
    step_ms = {f"{k}_ms_per_step": (after.get(k + "_sum", 0) - before.get(k + "_sum", 0)) / steps
               for k in STEP_HISTOGRAMS}
    ttft = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "constrained": constrained, "requests": n,
            "wall_s": wall,
            "tokens_per_s": tokens / wall, "mean_tokens": tokens / n,
            "stopped": sum(r["stopped"] for r in results),
            "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2], "ttft_p99_ms": 1e3 * ttft[-1],
            "steps": steps, **step_ms,
            "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0}}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def compile_times(model_dir: str, n: int) -> dict:
    """llguidance: tokenizer info once, then n distinct schemas (a cache miss each) and
    the mask of every position of one document; xgrammar beside it when importable."""
    out = {}
    t0 = time.perf_counter()
    vocab = so.grammar_vocab(model_dir)
    out["llguidance_vocab_s"] = time.perf_counter() - t0
    times = []
    for i in range(n):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"extra_{i}"] = {"type": "integer"}
        compiled = so.compile_spec(StructuredOutputSpec("json", json.dumps(schema)), vocab, 60)
        times.append(compiled.compile_s)
    out["llguidance_compile_ms"] = (1e3 * percentile(times, 0.5), 1e3 * percentile(times, 0.99))
    out["llguidance_mask_us"] = _llg_masks(vocab)
    try:
        out.update(_xgrammar(model_dir, n))
    except ImportError:
        out["xgrammar"] = "not installed"
    return out


DOCUMENT = ('{"name": "Ada", "age": 36, "color": "blue", '
            '"address": {"city": "London", "zip": "12345"}}')


def _llg_masks(vocab) -> tuple[float, float]:
    import tokenizers
    import torch
    tok = tokenizers.Tokenizer.from_file(str(Path(vocab.model_dir) / "tokenizer.json"))
    matcher = so.compile_spec(StructuredOutputSpec("json", json.dumps(SCHEMA)),
                              vocab).new_matcher()
    row = torch.zeros((vocab.vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for t in tok.encode(DOCUMENT, add_special_tokens=False).ids:
        t0 = time.perf_counter()
        matcher.fill_bitmask(row.data_ptr(), row.numel() * 4)
        times.append(time.perf_counter() - t0)
        assert matcher.accept(t)
    return 1e6 * percentile(times, 0.5), 1e6 * max(times)


def _xgrammar(model_dir: str, n: int) -> dict:
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    out = {"xgrammar_vocab_s": time.perf_counter() - t0}
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    times = []
    for i in range(n):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"extra_{i}"] = {"type": "integer"}
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        times.append(time.perf_counter() - t0)
    out["xgrammar_compile_ms"] = (1e3 * percentile(times, 0.5), 1e3 * percentile(times, 0.99))
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    mask_times = []
    for t in hf.encode(DOCUMENT, add_special_tokens=False):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        mask_times.append(time.perf_counter() - t0)
        assert matcher.accept_token(t)
    out["xgrammar_mask_us"] = (1e6 * percentile(mask_times, 0.5), 1e6 * max(mask_times))
    del torch
    return out


def spread(values: list[float], fmt: str) -> str:
    """median (min-max)"""
    return (f"{statistics.median(values):{fmt}} "
            f"({min(values):{fmt}}-{max(values):{fmt}})")


def table(rounds: dict[tuple[int, bool], list[dict]]) -> str:
    """One row a concurrency: medians (min-max) over the rounds; the ratio of the
    medians, then the spread of the per-round ratios (round r's json over round r's
    unconstrained, which ran just before it)."""
    lines = ["| concurrent | unconstrained tok/s | json_schema tok/s | ratio of medians "
             "(per-round min-max) | TTFT p50 unconstr. / json (ms) | tokens a request "
             "unconstr. / json | worker forward ms a step unconstr. / json | worker sample "
             "ms a step (mask inside) unconstr. / json |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    med = statistics.median
    for c in sorted({c for c, _ in rounds}):
        u, j = rounds[(c, False)], rounds[(c, True)]
        ut, jt = [p["tokens_per_s"] for p in u], [p["tokens_per_s"] for p in j]
        ratios = [b / a for a, b in zip(ut, jt)]
        lines.append(
            f"| {c} | {spread(ut, '.1f')} | {spread(jt, '.1f')} | {med(jt) / med(ut):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | "
            f"{med(p['ttft_p50_ms'] for p in u):.0f} / {med(p['ttft_p50_ms'] for p in j):.0f} | "
            f"{med(p['mean_tokens'] for p in u):.0f} / {med(p['mean_tokens'] for p in j):.0f} | "
            f"{med(p['forward_ms_per_step'] for p in u):.1f} / "
            f"{med(p['forward_ms_per_step'] for p in j):.1f} | "
            f"{med(p['sample_ms_per_step'] for p in u):.2f} / "
            f"{med(p['sample_ms_per_step'] for p in j):.2f} |")
    return "\n".join(lines)


def _cpu_line(cpu: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())


def cpu_table(rounds: dict[tuple[int, bool], list[dict]]) -> str:
    """CPU seconds of each process per 1,000 output tokens, medians over the rounds:
    what a constrained stream costs each process beyond the mask the worker times."""
    lines = ["| concurrent | " + " | ".join(f"{r} CPU s per 1k tokens, unconstr. / json"
                                          for r in (*ROLES, "client")) + " |",
             "|---:|" + "---:|" * (len(ROLES) + 1)]
    for c in sorted({c for c, _ in rounds}):
        cells = []
        for role in (*ROLES, "client"):
            u, j = (statistics.median(1e3 * p["cpu_s"][role] / (p["mean_tokens"] * p["requests"])
                                      for p in rounds[(c, k)]) for k in (False, True))
            cells.append(f"{u:.2f} / {j:.2f}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def overlap(args) -> dict:
    """Async vs sync, free vs constrained: the worker's idle share and mask time."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import async_overlap as ao
    from scheduler_svc.core.config import SchedulerConfig
    from scheduler_svc.core.request import Request
    from scheduler_svc.core.scheduler import Scheduler
    from scheduler_svc.engine import Engine

    ns = argparse.Namespace(model=args.model, device="cpu", worker_threads=1,
                            max_model_len=32 + args.max_tokens, prompt_len=32,
                            max_tokens=args.max_tokens, num_requests=args.overlap_requests,
                            max_num_batched_tokens=2048, seed=0)
    port = free_port()
    worker = ao.start_worker(ns, port)
    spec = StructuredOutputSpec("regex", "[a-z ,.]{400}")
    results = {}
    try:
        prompts = ao.make_prompts(ns, args.overlap_requests)
        for mode in ("async", "sync", "async", "sync"):
            for constrained in (False, True):
                group = ao.TimedGroup([f"127.0.0.1:{port}"])
                info = ao.handshake(group, worker, 300)
                cfg = SchedulerConfig(block_size=info.block_size, max_model_len=ns.max_model_len,
                                      max_num_seqs=ns.num_requests, max_num_batched_tokens=2048,
                                      async_scheduling=mode == "async")
                engine = Engine(Scheduler(cfg, info.num_kv_blocks), group, info,
                                cfg.max_model_len)
                group.open_streams()
                engine.start()
                try:
                    session = engine.open_session()
                    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                            structured_output=spec if constrained else None,
                                            stop_token_ids=[] if constrained else [])
                    for i, prompt in enumerate(prompts[:2]):  # warm (and compile) off the record
                        engine.add(session, Request(f"w{mode}{constrained}{i}", prompt,
                                                    SamplingParams(temperature=0.0, max_tokens=4,
                                                                   structured_output=params.structured_output),
                                                    info.eos_token_ids))
                    _drain(session, 2)
                    group.timings.clear()
                    t0 = time.perf_counter()
                    tag = f"{mode}-{int(constrained)}-{len(results)}"
                    for i, prompt in enumerate(prompts):
                        engine.add(session, Request(f"{tag}-{i}", prompt, params,
                                                    info.eos_token_ids))
                    arrivals = _drain(session, len(prompts))
                    timings = list(group.timings)
                    r = ao.summarize(t0, arrivals, timings).as_dict()
                    masked = [t.mask_ms for t in timings if t.mask_ms]
                    r["mask_ms_mean"] = sum(masked) / len(masked) if masked else 0.0
                    results.setdefault(f"{mode} {'regex' if constrained else 'free'}",
                                       []).append(r)
                finally:
                    engine.stop()
                    group.close()
    finally:
        worker.terminate()
        worker.wait(30)
    return results


def _drain(session, n: int) -> dict:
    from scheduler_svc.engine import CLOSED
    from scheduler_svc.engine_errors import Failure
    arrivals, done = {}, 0
    while done < n:
        items = session.outbox.get()
        now = time.perf_counter()
        assert items is not CLOSED
        for item in items:
            assert not isinstance(item, Failure), item
            if item.new_token_ids:
                arrivals.setdefault(item.req_id, []).append((now, len(item.new_token_ids)))
            done += item.finished
    return arrivals


def overlap_table(results: dict) -> str:
    lines = ["| mode | tokens/s | worker idle share | idle mean ms | mask ms a step |",
             "|---|---:|---:|---:|---:|"]
    for name, runs in results.items():
        for r in runs:
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {100 * r['worker_idle_share']:.2f}% | "
                         f"{r['worker_idle_ms_mean']:.2f} | {r['mask_ms_mean']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the default model)")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--compiles", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each point, unconstrained and constrained alternating; "
                        "the median and min-max are reported")
    p.add_argument("--json", default=None)
    p.add_argument("--overlap", action="store_true",
                   help="measure async overlap with and without grammars instead")
    p.add_argument("--overlap-requests", type=int, default=16)
    args = p.parse_args(argv)
    if args.overlap:
        results = overlap(args)
        print(overlap_table(results))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    from shared.model_files.default_model import ensure_default_model
    model_dir = args.model or str(ensure_default_model())
    backend = compile_times(model_dir, args.compiles)
    log = Path(tempfile.mkdtemp(prefix="structured-bench-")) / "serve.log"
    proc, address = start_stack(args.model, log)
    try:
        stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
        tok = __import__("transformers").AutoTokenizer.from_pretrained(model_dir)
        prompts = []
        for q in QUESTIONS:
            ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        one_stream(stub, prompts[0], True, 8)  # warm: the first compile at both ends
        rounds: dict[tuple[int, bool], list[dict]] = {}
        for c in (int(x) for x in args.concurrency.split(",")):
            for r in range(args.rounds):  # alternating: both see the same machine state
                for constrained in (False, True):
                    point = run_point(stub, prompts, c, constrained, args.max_tokens)
                    rounds.setdefault((c, constrained), []).append({**point, "round": r})
                    print(f"c={c} round {r} {'json' if constrained else 'free'}: "
                          f"{point['tokens_per_s']:.1f} tok/s, {point['mean_tokens']:.0f} "
                          f"tokens a request, sample {point['sample_ms_per_step']:.2f} ms "
                          f"a step, cpu s {_cpu_line(point['cpu_s'])}, "
                          f"{point['wall_s']:.1f} s wall, load {os.getloadavg()[0]:.2f}",
                          file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    points = [p for runs in rounds.values() for p in runs]
    print(table(rounds))
    print()
    print(cpu_table(rounds))
    for key, value in backend.items():
        print(f"{key}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps({"points": points, "backend": backend,
                                               "machine": platform.processor(),
                                               "loadavg_end": os.getloadavg(),
                                               "max_tokens": args.max_tokens}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
