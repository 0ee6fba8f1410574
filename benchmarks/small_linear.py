"""The matmuls of a decode step at small batches: oneDNN prepacked (what the worker uses
for wide batches), torch's F.linear, and the small-batch kernel (worker_svc/csrc/
small_linear.c), on the default model's shapes (30 layers: qkv, o_proj, gate_up, down;
then the vocabulary projection), fp32, bf16 and int8 weights (--quantization int8: the
kernel alone), fp32 activations.

    python benchmarks/small_linear.py [--threads 2] [--rows 1,2,4,8,12,16] [--repeats 7]
        [--dtypes float32,bfloat16,int8]

Each (rows, dtype) point times one pass over all the weights with every method in
turn, repeated --repeats times in alternation; it prints the median ms per pass, the
spread (min-max), the weight bytes per second of the median, and the median CPU time
of this process per pass (on a machine busy with other work, CPU time at --threads 1
moves much less than wall time). MAX_ROWS in
worker_svc/model/cpu/small_linear.py is where the kernel stops winning.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from worker_svc.model.cpu import small_linear
from worker_svc.model.cpu.cpu_dtype import PACK_BATCH, native_bf16

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M, [out, in]
VOCAB = (49152, 576)


def methods(dtype: torch.dtype | str):
    """name -> (weights, fn(x, w)) for every method available for this dtype."""
    kernel = small_linear.load()
    if dtype == "int8":
        if kernel is None:
            return {}
        weights = [small_linear.quantize_int8(torch.randn(o, i))
                   for o, i in [s for _ in range(LAYERS) for s in SHAPES] + [VOCAB]]
        return {"small_linear": (weights, kernel)}
    plain = [torch.randn(o, i).to(dtype) for _ in range(LAYERS) for o, i in SHAPES]
    plain.append(torch.randn(*VOCAB).to(dtype))
    out = {"F.linear": (plain, lambda x, w: F.linear(x.to(w.dtype), w).float())}
    if dtype == torch.float32 or native_bf16():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH) for w in plain]
        out["oneDNN packed"] = (packed, lambda x, w: torch.ops.mkldnn._linear_pointwise(
            x.to(w.dtype), w, None, "none", [], "").float())
        # oneDNN on the plain row-major weight (it reorders per call): what a worker
        # holding one copy would run instead of the packed one
        out["oneDNN plain"] = (plain, lambda x, w: torch.ops.mkldnn._linear_pointwise(
            x.to(w.dtype), w, None, "none", [], "").float())
    if kernel is not None:
        out["small_linear"] = (plain, kernel)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,2,4,8,12,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"torch {torch.__version__}, bf16 instructions: {native_bf16()}")
    print(f"{'dtype':9} {'rows':>4} {'method':14} {'median ms':>9} {'spread ms':>13} "
          f"{'GB/s':>6} {'cpu ms':>8}")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": "int8"}
    for dtype in (dtypes[d] for d in args.dtypes.split(",")):
        ms = methods(dtype)
        if not ms:
            continue
        nbytes = sum(t.numel() * t.element_size() for w in next(iter(ms.values()))[0]
                     for t in (w.tensors() if hasattr(w, "tensors") else (w,)))
        for rows in rows_list:
            xs = {i: torch.randn(rows, i) for i in {s[1] for s in SHAPES}}
            times = {name: [] for name in ms}
            cpu = {name: [] for name in ms}
            for _ in range(args.repeats + 1):  # the first round warms up, untimed
                for name, (weights, fn) in ms.items():
                    start, cpu_start = time.perf_counter(), time.process_time()
                    for w in weights:
                        fn(xs[w.shape[1]], w)
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - cpu_start)
            for name, ts in times.items():
                ts = ts[1:]
                med = statistics.median(ts)
                print(f"{str(dtype).removeprefix('torch.'):9} {rows:4d} {name:14} {med * 1e3:9.2f} "
                      f"{min(ts) * 1e3:6.2f}-{max(ts) * 1e3:6.2f} {nbytes / med / 1e9:6.1f} "
                      f"{statistics.median(cpu[name][1:]) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
