"""Speculative decoding against none, gapserve beside llama-server, one server at a time,
alternated and repeated (docs/spec_decode.md, docs/benchmarks.md):

    python benchmarks/spec_decode.py [--rows gapserve,gapserve-ngram,gapserve-int8draft,
        llamacpp,llamacpp-ngram,llamacpp-draft] [--workloads essay,copy,code]
        [--concurrency 1,8,64] [--repeats 3] [--json out.json]

Workloads (benchmarks/data/spec_prompts.json): `copy`, answers that repeat a text the
prompt carries (fix its typos; repeat it), and `code`, answers that repeat code with an
edit, both ending at the model's EOS; `essay`, serve_bench.py's essay prompt with EOS
ignored (side_by_side.py's workload). Each runs as a lone stream (one request at a
time, every prompt once), and at 8 and 64 in flight (the prompts cycled to that many
requests), greedy. Output tokens per second per row, medians over the repeats with
min-max, each speculating row over its own server's row without speculation, and
gapserve's rows over llama-server's best speculating row.

Rows: `gapserve` (fp32, no drafts), `gapserve-ngram` (prompt lookup), `gapserve-int8draft`
(the served model's own int8 copy drafts; the fp32 model verifies: the text stays fp32's);
`llamacpp` (f32 GGUF), `llamacpp-ngram` (--spec-type ngram-simple, its docs' example),
`llamacpp-ngram-mod` (--spec-default: ngram-mod), `llamacpp-draft` (draft-simple: the f32
target with the Q8_0 GGUF of the same checkpoint as its draft model, llama.cpp's
nearest to the self-draft). Each server gets every core. The first repeat also checks
that every gapserve row's greedy texts equal the no-speculation row's.

Acceptance: gapserve's from /v1/status (vLLM's counters) over each run; llama-server's
from the `draft acceptance` lines its log prints per request.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serve_bench  # noqa: E402
import server_runs  # noqa: E402
import side_by_side as sbs  # noqa: E402

PROMPTS = HERE / "data" / "spec_prompts.json"
ROWS = ("gapserve", "gapserve-ngram", "gapserve-int8draft", "llamacpp", "llamacpp-ngram",
        "llamacpp-ngram-mod", "llamacpp-draft")
BASELINE = {"gapserve-ngram": "gapserve", "gapserve-int8draft": "gapserve",
            "llamacpp-ngram": "llamacpp", "llamacpp-ngram-mod": "llamacpp",
            "llamacpp-draft": "llamacpp"}
WORKLOADS = ("essay", "copy", "code")
ESSAY_TOKENS = 128  # side_by_side.py's
ANSWER_TOKENS = 320  # copy/code answers end at EOS well before this


def spec_json(method: str, k: int, limit: int | None, lookup: tuple[int, int]) -> str:
    cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup[0],
           "prompt_lookup_max": lookup[1]} if method == "ngram" else \
        {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": k}
    if limit:
        cfg["disable_by_batch_size"] = limit
    return json.dumps(cfg)


def server_commands(args: argparse.Namespace) -> dict[str, dict]:
    """name -> argv, env, port: side_by_side.py's, with the speculative flags."""
    args.concurrency = max(args.levels)  # llama-server's slots
    args.max_tokens = ANSWER_TOKENS
    base = sbs.server_commands(args)
    lookup = (args.ngram_min, args.ngram_max)

    def gapserve(spec: str | None) -> dict:
        cmd = dict(base["gapserve"])
        cmd["argv"] = [*cmd["argv"], *(["--speculative-config", spec] if spec else [])]
        return cmd

    def llama(*extra: str) -> dict:
        cmd = dict(base["llamacpp"])
        cmd["argv"] = [*cmd["argv"], *extra]
        return cmd

    return {
        "gapserve": gapserve(None),
        "gapserve-ngram": gapserve(spec_json("ngram", args.ngram_k, args.disable_by_batch_size,
                                             lookup)),
        "gapserve-int8draft": gapserve(spec_json("draft", args.draft_k,
                                                 args.disable_by_batch_size, lookup)),
        "llamacpp": llama(),
        # docs/speculative.md's ngram-simple example, and --spec-default (ngram-mod)
        "llamacpp-ngram": llama("--spec-type", "ngram-simple", "--spec-draft-n-max",
                                str(args.llama_ngram_max)),
        "llamacpp-ngram-mod": llama("--spec-default"),
        "llamacpp-draft": llama("--spec-type", "draft-simple", "-md", args.llama_gguf_q8,
                                "--spec-draft-n-max", str(args.llama_draft_max)),
    }


def requests_file(workload: str, count: int, tmp: Path) -> Path:
    """A serve_bench --prompt-file: the workload's prompts cycled to `count` requests."""
    if workload == "essay":
        items = [{"messages": [{"role": "user",
                                "content": serve_bench.ESSAY_PROMPT.format(i=i)}],
                  "max_tokens": ESSAY_TOKENS} for i in range(count)]
    else:
        prompts = json.loads(PROMPTS.read_text())[workload]
        items = [{"messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                  "max_tokens": ANSWER_TOKENS} for i in range(count)]
    path = tmp / f"{workload}-{count}.json"
    path.write_text(json.dumps(items))
    return path


def num_requests(workload: str, level: int) -> int:
    """A lone stream: every prompt once (8); in flight: two waves of the level (at least
    16), so a run is not one burst whose timing of arrival decides the throughput."""
    return 8 if level == 1 else max(2 * level, 16)


def run_load(base_url: str, workload: str, level: int, tmp: Path) -> dict:
    path = requests_file(workload, num_requests(workload, level), tmp)
    out = tmp / "report.json"
    argv = [sys.executable, str(HERE / "serve_bench.py"), "--base-url", base_url,
            "--prompt-file", str(path), "--num-requests", str(num_requests(workload, level)),
            "--concurrency", str(level), "--temperature", "0", "--warmup", "1",
            "--json", str(out), "--quiet", *(["--ignore-eos"] if workload == "essay" else [])]
    client = subprocess.run(argv, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True)
    if client.returncode != 0 or not out.exists():
        raise RuntimeError(f"serve_bench failed: {client.stderr.strip()[-2000:]}")
    return json.loads(out.read_text())


def gapserve_spec(base: str) -> dict | None:
    try:
        return httpx.get(base.removesuffix("/v1") + "/v1/status", timeout=10).json() \
            .get("spec_decode")
    except (httpx.HTTPError, ValueError):
        return None


def llama_acceptance(log_text: str) -> tuple[int, int]:
    """(accepted, generated) summed over the `draft acceptance` lines of a log."""
    got = re.findall(r"draft acceptance(?: rate)? = [0-9.]+ \(\s*(\d+) accepted /\s*(\d+) "
                     r"generated", log_text)
    return sum(int(a) for a, _ in got), sum(int(g) for _, g in got)


def greedy_texts(base_url: str, workload: str) -> list[str]:
    """Every prompt's greedy answer (non-streamed, 8 at a time): the exactness check."""
    prompts = json.loads(PROMPTS.read_text())[workload] if workload != "essay" else [
        serve_bench.ESSAY_PROMPT.format(i=i) for i in range(4)]
    model = httpx.get(base_url + "/models", timeout=10).json()["data"][0]["id"]

    async def one(client, text):
        body = {"model": model, "messages": [{"role": "user", "content": text}],
                "max_tokens": ESSAY_TOKENS if workload == "essay" else ANSWER_TOKENS,
                "temperature": 0, **({"ignore_eos": True} if workload == "essay" else {})}
        r = await client.post(base_url + "/chat/completions", json=body, timeout=600)
        return r.json()["choices"][0]["message"]["content"]

    async def all_():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, t) for t in prompts))
    return asyncio.run(all_())


def run_row(name: str, spec: dict, args: argparse.Namespace, repeat: int, tmp: Path) -> dict:
    base_url = f"http://127.0.0.1:{spec['port']}/v1"
    log_path = Path(args.log_dir) / f"spec_decode-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=sbs.ROOT)
    try:
        server_runs.wait_ready(base_url, proc, args.startup_timeout)
        result = {"command": " ".join(spec["argv"]), "runs": {}}
        if repeat == 0 and name.startswith("gapserve"):
            result["texts"] = {w: greedy_texts(base_url, w) for w in args.workload_names}
        for workload in args.workload_names:
            for level in args.levels:
                before, log_before = gapserve_spec(base_url), log_path.read_text(errors="replace")
                t0 = (time.monotonic(), server_runs.busy_ticks())
                report = run_load(base_url, workload, level, tmp)
                wall = time.monotonic() - t0[0]
                # the whole machine
                report["busy_cores"] = ((server_runs.busy_ticks() - t0[1])
                                        / server_runs.TICKS / wall)
                after = gapserve_spec(base_url)
                if after is not None:
                    b = before or {"num_draft_tokens": 0, "num_accepted_tokens": 0}
                    report["drafts"] = (after["num_accepted_tokens"] - b["num_accepted_tokens"],
                                        after["num_draft_tokens"] - b["num_draft_tokens"])
                elif name.startswith("llamacpp"):
                    new = log_path.read_text(errors="replace")[len(log_before):]
                    report["drafts"] = llama_acceptance(new)
                result["runs"][f"{workload}@{level}"] = report
                print(f"{name} #{repeat + 1} {workload} x{level}: "
                      f"{report['output_throughput']:.1f} tok/s"
                      + (f", accepted {report['drafts'][0]}/{report['drafts'][1]}"
                         if report.get("drafts") and report["drafts"][1] else ""),
                      file=sys.stderr)
        return result
    finally:
        server_runs.stop(proc)


def markdown(results: dict) -> str:
    rows = results["rows"]
    keys = [f"{w}@{n}" for w in results["workloads"] for n in results["levels"]]

    def tok_s(name: str, key: str) -> list[float]:
        return [r["runs"][key]["output_throughput"] for r in rows[name]["repeats"]]

    def median(name: str, key: str) -> float:
        return sbs.spread(tok_s(name, key))["median"]

    head = "| row | " + " | ".join(k.replace("@", " x") for k in keys) + " |"
    lines = ["Output tokens/s, medians (min-max); acceptance = accepted / proposed drafts\n",
             head, "|" + " --- |" * (len(keys) + 1)]
    for name in rows:
        cells = []
        for key in keys:
            cell = sbs._cell(sbs.spread(tok_s(name, key)), ".1f")
            drafts = [r["runs"][key].get("drafts") for r in rows[name]["repeats"]]
            acc = sum(d[0] for d in drafts if d), sum(d[1] for d in drafts if d)
            if acc[1]:
                cell += f", acc {acc[0] / acc[1]:.2f}"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("\nRatios of medians:\n")
    spec_rows = [n for n in rows if n in BASELINE and BASELINE[n] in rows]
    for name in spec_rows:
        ratios = [median(name, k) / median(BASELINE[name], k) for k in keys]
        lines.append(f"- {name} / {BASELINE[name]}: " + ", ".join(
            f"{k.replace('@', ' x')} {r:.2f}x" for k, r in zip(keys, ratios)))
    llama_spec = [n for n in rows if n.startswith("llamacpp-")]
    for name in [n for n in rows if n.startswith("gapserve-")]:
        for key in keys:
            if llama_spec:
                best = max(llama_spec, key=lambda n: median(n, key))
                lines.append(f"- {name} / {best} (llama-server's best speculating row at "
                             f"{key.replace('@', ' x')}): {median(name, key) / median(best, key):.2f}x")
    exact = results.get("exact")
    if exact:
        lines.append("\nGreedy texts equal to gapserve without speculation: " + ", ".join(
            f"{n} {'yes' if ok else 'NO'}" for n, ok in exact.items()))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(r for r in ROWS if r != "llamacpp-ngram-mod"),
                   help=f"comma-separated, in this order each repeat: {', '.join(ROWS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--concurrency", default="1,8,64", help="in-flight levels, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ngram-k", type=int, default=5)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=5)
    p.add_argument("--draft-k", type=int, default=5)
    p.add_argument("--disable-by-batch-size", type=int, default=16,
                   help="gapserve's rows: no drafts in a step while this many requests "
                   "are enqueued (0: never off)")
    p.add_argument("--llama-ngram-max", type=int, default=64,
                   help="--spec-draft-n-max of llamacpp-ngram (its docs' example: 64)")
    p.add_argument("--llama-draft-max", type=int, default=8,
                   help="--spec-draft-n-max of llamacpp-draft (its default is 3; 8 did "
                        "better here: docs/spec_decode.md)")
    p.add_argument("--model", default=str(Path.home() / ".cache/gapserve/SmolLM2-135M-Instruct"))
    sbs.add_llama_server_flags(p, gguf_default=sbs.LLAMA_F32_GGUF)
    p.add_argument("--port", type=int, default=19000)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--vllm-python", default="")  # side_by_side's commands take it; unused
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    args.row_names = args.rows.split(",")
    args.workload_names = args.workloads.split(",")
    args.levels = [int(x) for x in args.concurrency.split(",")]
    args.model_dir = args.model  # where llama-server's KV size is read (a checkpoint directory)
    bad = [n for n in args.row_names if n not in ROWS] + \
        [w for w in args.workload_names if w not in WORKLOADS]
    if bad or args.repeats < 1 or min(args.levels) < 1:
        p.error(f"unknown rows/workloads {bad}, or --repeats / --concurrency below 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = server_commands(args)
    cpu, flags = server_runs.cpu_info()
    results = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
               "machine": f"{os.cpu_count()} cores, {cpu}",
               "cpu_flags": [f for f in flags if f.startswith(("avx", "amx", "fma"))],
               "workloads": args.workload_names, "levels": args.levels,
               "repeats": args.repeats, "settings": {k: getattr(args, k) for k in (
                   "ngram_k", "ngram_min", "ngram_max", "draft_k", "disable_by_batch_size",
                   "llama_ngram_max", "llama_draft_max")}, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in args.row_names:
                try:
                    run = run_row(name, specs[name], args, repeat, Path(tmp))
                except (RuntimeError, OSError) as exc:
                    print(f"spec_decode: {name}: {exc}", file=sys.stderr)
                    return 2
                entry = results["rows"].setdefault(name, {"repeats": []})
                entry["repeats"].append(run)
                if "texts" in run:
                    entry["texts"] = run.pop("texts")
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    plain = results["rows"].get("gapserve", {}).get("texts")
    if plain:
        results["exact"] = {n: r.get("texts") == plain for n, r in results["rows"].items()
                            if n.startswith("gapserve-") and r.get("texts")}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{results['date']}, {results['machine']} ({' '.join(results['cpu_flags'])}), "
          f"medians of {args.repeats} alternated runs\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
