"""The default model's GGUF on the quantized path against the exact (dequantized fp32)
path: the matmuls of a step at 1..8 rows (and wider with --rows), and the worker's
load time and resident memory on each path.

    python benchmarks/quant_matmul.py [--threads 2] [--rows 1,2,4,8] [--repeats 7]
                                      [--loads 2] [--gguf PATH]

Matmuls: one pass over every weight of the model (30 layers of qkv, o_proj, gate_up,
down, then the vocabulary projection), as the file holds them (SmolLM2's Q4_1 layers,
Q8_0 embedding) through the quantized kernel (csrc/quant_linear.c), the same weights
repacked for the int8-activation path (--quant-activations int8, csrc/quant_packed.h),
and the same
weights dequantized to fp32 through the small-batch kernel (csrc/small_linear.c) and
oneDNN prepacked: methods in alternation, --repeats rounds, median ms per pass, the
spread and the bytes each method reads per second. Loads: a worker's ModelRunner
built in a fresh process per path (alternating, --loads times each): seconds to
build it, its RSS after loading and the weight bytes it holds; the int8 path's load
includes its repacking.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from worker_svc.model.cpu import quant_weights, small_linear
from worker_svc.model.cpu.cpu_dtype import PACK_BATCH

MATMULS = ("qkv", "o_proj", "gate_up", "down")


def _model_dir(gguf: str | None) -> Path:
    from shared.model_files.default_model import resolve_model
    return resolve_model(gguf)


def matmul_weights(model_dir: Path):
    """(quantized weights, fp32 copies) of every matmul and the vocabulary projection."""
    from worker_svc.model import llama
    from worker_svc.model.config import load_model_config
    from worker_svc.model.loading.gguf_quantized import load_quantized_weights
    w = load_quantized_weights(model_dir, load_model_config(model_dir), llama)
    quant = [getattr(lw, n) for lw in w.layers for n in MATMULS] + [w.lm_head]
    return quant, [q.dequantize() for q in quant]


def bench_matmuls(args, model_dir: Path) -> None:
    quant, plain = matmul_weights(model_dir)
    packed = [torch.ops.mkldnn._reorder_linear_weight(t, PACK_BATCH) for t in plain]
    kq, kf = quant_weights.load(), small_linear.load()
    repacked = [quant_weights.pack(q) for q in quant]
    methods = {
        "quant_linear": (quant, kq),
        "quant_linear int8": (repacked, kq),
        "small_linear fp32": (plain, kf),
        "oneDNN fp32": (packed, lambda x, w: torch.ops.mkldnn._linear_pointwise(
            x, w, None, "none", [], "")),
    }
    nbytes = {"quant_linear": sum(t.numel() for q in quant for t in q.tensors()),
              "quant_linear int8": sum(t.numel() for q in repacked for t in q.tensors()),
              "small_linear fp32": sum(t.numel() * 4 for t in plain)}
    nbytes["oneDNN fp32"] = nbytes["small_linear fp32"]
    types = sorted({k for q in quant for k in q.types})
    print(f"\n## matmuls: one pass over the model's weights ({'+'.join(types)}: "
          f"{nbytes['quant_linear'] / 2**20:.1f} MiB quantized, "
          f"{nbytes['oneDNN fp32'] / 2**20:.1f} MiB fp32)")
    print(f"(int8: its loop is {kq.packed_loop})")
    print(f"{'rows':>4} {'method':18} {'median ms':>9} {'spread ms':>15} {'GB/s':>6} "
          f"{'vs fp32 kernel':>14}")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {i: torch.randn(rows, i) for i in {t.shape[1] for t in plain}}
        times = {name: [] for name in methods}
        for _ in range(args.repeats + 1):  # the first round warms up, untimed
            for name, (weights, fn) in methods.items():
                start = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                times[name].append(time.perf_counter() - start)
        ref = statistics.median(times["small_linear fp32"][1:])
        for name, ts in times.items():
            ts = ts[1:]
            med = statistics.median(ts)
            print(f"{rows:4d} {name:18} {med * 1e3:9.2f} {min(ts) * 1e3:7.2f}-"
                  f"{max(ts) * 1e3:7.2f} {nbytes[name] / med / 1e9:6.1f} {ref / med:13.2f}x")


def _load_once(model_dir: str, dtype: str, threads: int, activations: str) -> dict:
    """A worker's load in a fresh process: seconds, RSS, weight bytes."""
    code = f"""
import json, time, torch
torch.set_num_threads({threads})
start = time.perf_counter()
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner
r = ModelRunner(WorkerConfig(model={model_dir!r}, device="cpu", dtype={dtype!r},
                             max_model_len=512, num_gpu_blocks_override=40, max_num_seqs=4,
                             cpu_threads={threads}, quant_activations={activations!r}))
took = time.perf_counter() - start
rss = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
print(json.dumps(dict(load_s=took, rss_mib=rss / 1024, weight_mib=r.weight_bytes / 2**20,
                      plan=r.compute_plan.summary())))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_loads(args, model_dir: Path) -> None:
    paths = {"quantized (default)": ("auto", "float32"),
             "quantized, int8 activations": ("auto", "int8"),
             "exact (--dtype float32)": ("float32", "float32")}
    runs = {name: [] for name in paths}
    for _ in range(args.loads):
        for name, (dtype, activations) in paths.items():
            runs[name].append(_load_once(str(model_dir), dtype, args.threads, activations))
    from shared.model_files.gguf_model import gguf_source
    source = gguf_source(model_dir)
    size = source.stat().st_size if source is not None else 0
    print(f"\n## worker load ({args.loads} alternating loads each, medians; GGUF file "
          f"{size / 2**20:.1f} MiB; KV cache 40 blocks)")
    print(f"{'path':28} {'load s':>7} {'RSS MiB':>8} {'weights MiB':>11}")
    for name, rs in runs.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        print(f"{name:28} {med('load_s'):7.2f} {med('rss_mib'):8.1f} {med('weight_mib'):11.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--loads", type=int, default=2, help="loads per path (0: none)")
    ap.add_argument("--gguf", default=None, help="a GGUF (default: the default model's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = _model_dir(args.gguf)
    flags = sorted(f for f in small_linear_flags() if f.startswith(("avx2", "avx512", "fma")))
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}, "
          f"cpu flags: {' '.join(flags)}")
    bench_matmuls(args, model_dir)
    if args.loads:
        bench_loads(args, model_dir)


def small_linear_flags() -> frozenset[str]:
    from worker_svc.model.cpu.cpu_dtype import cpu_flags
    return cpu_flags()


if __name__ == "__main__":
    main()
