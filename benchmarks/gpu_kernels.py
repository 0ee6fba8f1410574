"""GPU check of the Triton paged-attention kernels, in one run of under 5 minutes:

  (a) correctness at real sizes against the fp32 torch reference on random data
      (never zeros; NaN in every cache slot no request owns and in the output buffer,
      so a stray read or an unwritten element shows);
  (b) decode attention timings at 64 and 256 sequences x 1k and 8k contexts for a
      Llama-8B-like shape (32 query heads, 8 KV heads, head dim 128, bf16), as
      achieved memory bandwidth against the device's measured copy bandwidth; plus
      one long sequence with and without split-K;
  (c) the default model end to end through the worker's ModelRunner: decode
      tokens/s at batch 1 and 64, Triton backend and torch backend.

    .venv/bin/python benchmarks/gpu_kernels.py [--json results.json]
    .venv/bin/python benchmarks/gpu_kernels.py --smoke   # CPU, Triton interpreter, tiny sizes:
                                                         # checks the script, not the GPU

Part (c) uses --model, else the converted default model when it is already on disk
(`python -m shared.model_files.default_model` converts it); it never downloads. Without either
it builds a checkpoint with the default model's exact architecture and random
weights, which decodes at the same speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if "--smoke" in sys.argv:  # must precede the first kernel import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from worker_svc.attention import torch_backend, triton_backend  # noqa: E402
from worker_svc.attention.metadata import AttentionMetadata  # noqa: E402
from worker_svc.attention.reference import reference_attention  # noqa: E402
from worker_svc.kernels.decode import choose_num_splits, paged_decode  # noqa: E402
from worker_svc.kernels.kv_write import write_kv  # noqa: E402
from worker_svc.kernels.prefill import paged_prefill  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)
DEFAULT_MODEL = dict(num_heads=9, num_kv_heads=3, head_dim=64)
PAGE = 16
ROWS: list[dict] = []  # the final table


def row(part: str, case: str, result: str, **extra) -> None:
    ROWS.append(dict(part=part, case=case, result=result, **extra))
    print(f"[{part}] {case}: {result}", flush=True)


# ---------------------------------------------------------------- paged batches


def paged_batch(q_lens, seq_lens, *, num_heads, num_kv_heads, head_dim, dtype, device,
                poison=True, seed=0):
    """Random cache and queries with scattered block tables. With poison, block 0 and
    every slot past a request's context hold NaN."""
    g = torch.Generator(device).manual_seed(seed)
    blocks_per_req = [-(-s // PAGE) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    kv_cache = torch.randn(2, num_blocks, PAGE, num_kv_heads, head_dim, generator=g,
                           device=device, dtype=dtype)
    perm = torch.randperm(num_blocks - 1, generator=g, device=device).to(torch.int32) + 1
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32,
                              device=device)
    start = 0
    for i, (n, s) in enumerate(zip(blocks_per_req, seq_lens)):
        block_table[i, :n] = perm[start:start + n]
        start += n
        if poison and s % PAGE:
            kv_cache[:, int(perm[start - 1]), s % PAGE:] = float("nan")
    if poison:
        kv_cache[:, 0] = float("nan")
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, device=device,
                        dtype=dtype)
    starts = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device=device),
        query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
                                                      device=device),
        block_table=block_table, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return query, kv_cache, meta


def rel_error(got, query, kv_cache, meta, scale) -> float:
    want = reference_attention(query.float(), kv_cache.float(), meta, scale)
    if torch.isnan(got).any():
        return math.inf
    return ((got.float() - want).abs().max() / want.abs().max()).item()


# ---------------------------------------------------------------- (a) correctness


def check_attention(name, q_lens, seq_lens, shape, dtype, device, launch):
    query, kv_cache, meta = paged_batch(q_lens, seq_lens, dtype=dtype, device=device, **shape)
    scale = shape["head_dim"] ** -0.5
    out = torch.full_like(query, float("nan"))
    launch(query, kv_cache, meta, scale, out)
    err = rel_error(out, query, kv_cache, meta, scale)
    ok = err < TOLERANCE[dtype]
    row("a", f"{name} {str(dtype)[6:]}", f"{'PASS' if ok else 'FAIL'} rel err {err:.1e}",
        ok=ok, rel_err=err)


def decode_launch(num_splits):
    def launch(query, kv_cache, meta, scale, out):
        paged_decode(query, kv_cache[0], kv_cache[1], meta.block_table, meta.seq_lens,
                     meta.query_start_loc, scale, num_splits=num_splits, out=out)
    return launch


def prefill_launch(query, kv_cache, meta, scale, out):
    paged_prefill(query, kv_cache[0], kv_cache[1], meta.block_table, meta.seq_lens,
                  meta.query_start_loc, meta.max_query_len, scale, out=out)


def check_kv_write(device, dtype, smoke):
    g = torch.Generator(device).manual_seed(7)
    n, blocks = (5, 4) if smoke else (4096, 1024)
    cache = torch.randn(2, blocks, PAGE, 8, 128, generator=g, device=device, dtype=dtype)
    key = torch.randn(n, 8, 128, generator=g, device=device, dtype=dtype)
    value = torch.randn(n, 8, 128, generator=g, device=device, dtype=dtype)
    slots = torch.randperm(blocks * PAGE, generator=g, device=device)[:n]
    slots[::7] = -1  # padding tokens
    want = cache.clone()
    keep = slots >= 0
    want.view(2, -1, 8, 128)[0, slots[keep]] = key[keep]
    want.view(2, -1, 8, 128)[1, slots[keep]] = value[keep]
    write_kv(key, value, cache, slots)
    ok = torch.equal(cache, want)
    row("a", f"kv_write {n} tokens {str(dtype)[6:]}", "PASS exact" if ok else "FAIL", ok=ok)


def part_a(device, smoke):
    torch.manual_seed(0)
    if smoke:
        dec_lens, long_lens = [1, 16, 17, 50], [700]
        mixed_q, mixed_seq = [13, 1, 6, 1], [13, 17, 22, 40]
        dtypes = [torch.float32, torch.bfloat16]
    else:
        # block edges, 1 token, and a spread up to 8k
        dec_lens = [1, 16, 17, 8192] + torch.randint(1, 4096, (60,)).tolist()
        long_lens = [8192, 5000]
        mixed_q = [512, 1, 1, 300, 1, 64, 2048]
        mixed_seq = [512, 1001, 8192, 2300, 17, 3064, 2048]
        dtypes = [torch.bfloat16, torch.float16, torch.float32]
    for dtype in dtypes:
        shapes = [("llama-8b", LLAMA_8B), ("default-model", DEFAULT_MODEL)]
        if dtype == torch.float16:  # same code as bf16 on a GPU: one shape is enough
            shapes = shapes[:1]
        for label, shape in shapes:
            check_attention(f"decode {label} {len(dec_lens)} seqs", [1] * len(dec_lens),
                            dec_lens, shape, dtype, device, decode_launch(1))
            splits = max(2, choose_num_splits(len(long_lens), shape["num_kv_heads"],
                                              max(long_lens), 132))
            check_attention(f"split-K decode {label} x{splits}", [1] * len(long_lens),
                            long_lens, shape, dtype, device, decode_launch(splits))
            check_attention(f"prefill+decode {label} {sum(mixed_q)} tokens", mixed_q,
                            mixed_seq, shape, dtype, device, prefill_launch)
        check_kv_write(device, dtype, smoke)


# ---------------------------------------------------------------- (b) timings


def time_ms(fn, device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()  # the interpreter: one run, for the script's logic only
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def copy_bandwidth(device, smoke) -> float:
    n = (1 << 20) if smoke else (1 << 31)  # 2 GiB: far past any cache
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * n / ms / 1e6  # read + write, GB/s


def part_b(device, smoke):
    copy_gbs = copy_bandwidth(device, smoke)
    row("b", "device copy bandwidth", f"{copy_gbs:.0f} GB/s", gbs=copy_gbs)
    shape, dtype = LLAMA_8B, torch.bfloat16
    grid = [(2, 64), (3, 32)] if smoke else [(64, 1024), (64, 8192), (256, 1024),
                                             (256, 8192)]
    for batch, ctx in grid:
        timed_decode(batch, ctx, shape, dtype, device, copy_gbs, with_torch=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # few long sequences: split-K against one program per (sequence, KV head)
    batch, ctx = (1, 600) if smoke else (1, 8192)
    timed_decode(batch, ctx, shape, dtype, device, copy_gbs, with_torch=False)
    timed_decode(batch, ctx, shape, dtype, device, copy_gbs, with_torch=False, num_splits=1)


def timed_decode(batch, ctx, shape, dtype, device, copy_gbs, with_torch, num_splits=None):
    query, kv_cache, meta = paged_batch([1] * batch, [ctx] * batch, dtype=dtype,
                                        device=device, poison=False, **shape)
    scale = shape["head_dim"] ** -0.5
    kv_bytes = batch * ctx * shape["num_kv_heads"] * shape["head_dim"] * 2 * dtype.itemsize
    moved = kv_bytes + 2 * query.numel() * dtype.itemsize + meta.block_table.numel() * 4
    if num_splits is None:
        auto = choose_num_splits(batch, shape["num_kv_heads"], ctx,
                                 triton_backend._num_sms(device))
        label = f"decode {batch} seqs x {ctx} ctx (splits {auto})"
        ms = time_ms(lambda: triton_backend.attention(query, kv_cache, meta, scale), device)
    else:
        label = f"decode {batch} seqs x {ctx} ctx (forced splits {num_splits})"
        ms = time_ms(lambda: paged_decode(query, kv_cache[0], kv_cache[1], meta.block_table,
                                          meta.seq_lens, meta.query_start_loc, scale,
                                          num_splits=num_splits), device)
    gbs = moved / ms / 1e6
    extra = ""
    torch_ms = None
    if with_torch:
        try:
            torch_ms = time_ms(lambda: torch_backend.attention(query, kv_cache, meta, scale),
                               device)
            extra = f"; torch path {torch_ms:.3f} ms"
        except torch.OutOfMemoryError:
            extra = "; torch path out of memory"
    row("b", label, f"{ms:.3f} ms, {gbs:.0f} GB/s = {100 * gbs / copy_gbs:.0f}% of copy"
        + extra, ms=ms, gbs=gbs, torch_ms=torch_ms)
    del query, kv_cache, meta


# ---------------------------------------------------------------- (c) end to end


def model_dir(smoke: bool, tmp: Path, given: Path | None) -> tuple[Path, str]:
    if given is not None:
        return given, str(given)
    if not smoke:
        from shared.model_files.default_model import default_gguf_path, ensure_default_model
        if default_gguf_path().is_file():  # its view is built from the file, no network
            return ensure_default_model(), "default model"
        # never fetch here: a GPU box may have no network, and pip would retry for minutes
        print("default model not fetched on this machine; using random weights with "
              "its architecture (same speed)", flush=True)
    from transformers import LlamaConfig, LlamaForCausalLM
    arch = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                eos_token_id=2, pad_token_id=2)
    what = "default-model architecture, random weights"
    if smoke:
        what = "tiny Llama, random weights (smoke)"
        arch.update(hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                    vocab_size=256, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**arch)).save_pretrained(str(tmp / "ckpt"))
    return tmp / "ckpt", what


class Decoder:
    """Speaks the SchedulerOutput contract to a ModelRunner: one prefill step for all
    requests, then one decode step at a time (new blocks as contexts cross them)."""

    def __init__(self, runner, batch: int, prompt_len: int, vocab: int):
        from shared.types import NewRequestData, SamplingParams, SchedulerOutput
        self.runner, self.bs = runner, runner.block_size
        self.free = list(range(runner.num_kv_blocks - 1, 0, -1))
        self.ids = [f"r{i}" for i in range(batch)]
        self.blocks = {r: [] for r in self.ids}
        self.computed = {r: 0 for r in self.ids}
        self.step_id = 0
        step = SchedulerOutput(step_id=self._next_id())
        g = torch.Generator().manual_seed(1)
        for r in self.ids:
            prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
            new_blocks = self._grow(r, prompt_len)
            step.scheduled_new_reqs.append(NewRequestData(
                r, prompt, SamplingParams(temperature=0.0, max_tokens=100_000,
                                          ignore_eos=True), new_blocks, 0))
            step.num_scheduled_tokens[r] = prompt_len
        step.total_num_scheduled_tokens = batch * prompt_len
        self.tokens: dict[str, list[int]] = {r: [] for r in self.ids}
        self._run(step)

    def _next_id(self) -> int:
        self.step_id += 1
        return self.step_id - 1

    def _grow(self, r: str, n: int) -> list[int]:
        need = -(-(self.computed[r] + n) // self.bs) - len(self.blocks[r])
        new = [self.free.pop() for _ in range(max(need, 0))]
        self.blocks[r].extend(new)
        self.computed[r] += n
        return new

    def _run(self, step):
        out = self.runner.execute(step)
        for r, toks in zip(out.req_ids, out.sampled_token_ids):
            self.tokens[r].extend(toks)
        return out

    def decode_step(self):
        from shared.types import CachedRequestData, SchedulerOutput
        step = SchedulerOutput(step_id=self._next_id(), total_num_scheduled_tokens=len(self.ids))
        cached = CachedRequestData()
        for r in self.ids:
            before = self.computed[r]
            cached.append(r, False, self._grow(r, 1), before)
            step.num_scheduled_tokens[r] = 1
        step.scheduled_cached_reqs = cached
        return self._run(step)


def part_c(device, smoke, model=None):
    from worker_svc.config import WorkerConfig
    from worker_svc.runner import ModelRunner
    prompt_len, warmup, steps = (8, 1, 2) if smoke else (128, 5, 64)
    with tempfile.TemporaryDirectory() as tmp:
        path, what = model_dir(smoke, Path(tmp), model)
        row("c", "model", what)
        greedy: dict[str, dict] = {}
        for batch in (1, 64 if not smoke else 4):
            for backend in ("triton", "torch"):
                cfg = WorkerConfig(model=str(path), device=device.type,
                                   dtype="float32" if smoke else "bfloat16",
                                   num_gpu_blocks_override=4096, max_num_seqs=batch,
                                   max_num_batched_tokens=max(2048, batch * prompt_len))
                runner = ModelRunner(cfg)
                chosen = runner.model.backend.__name__.rsplit(".", 1)[-1]
                runner.model.backend = triton_backend if backend == "triton" else torch_backend
                dec = Decoder(runner, batch, prompt_len, runner.model_config.vocab_size)
                for _ in range(warmup):
                    dec.decode_step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(steps):
                    dec.decode_step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t
                tps = batch * steps / elapsed
                greedy[backend] = dec.tokens
                row("c", f"decode batch {batch} {backend} (runner picked {chosen})",
                    f"{tps:.0f} tokens/s, {1e3 * elapsed / steps:.2f} ms/step", tps=tps)
                del runner, dec
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            same = sum(a == b for r in greedy["triton"]
                       for a, b in zip(greedy["triton"][r], greedy["torch"][r]))
            total = sum(len(t) for t in greedy["triton"].values())
            row("c", f"greedy tokens batch {batch}: triton == torch path",
                f"{same}/{total} equal", equal=same, total=total)


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU under the Triton interpreter")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--parts", default="abc", help="which parts to run, e.g. ab")
    parser.add_argument("--model", type=Path, help="checkpoint directory for part (c)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or use --smoke to check the script")
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    name = "CPU (Triton interpreter)" if args.smoke else torch.cuda.get_device_name(device)
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    for part, run in (("a", lambda: part_a(device, args.smoke)),
                      ("b", lambda: part_b(device, args.smoke)),
                      ("c", lambda: part_c(device, args.smoke, args.model))):
        if part in args.parts:
            start = time.perf_counter()
            run()
            print(f"part {part} took {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\n{name}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s")
    width = max(len(r["case"]) for r in ROWS)
    print(f"{'part':4}  {'case':{width}}  result")
    for r in ROWS:
        print(f"{r['part']:4}  {r['case']:{width}}  {r['result']}")
    if args.json:
        args.json.write_text(json.dumps(dict(device=name, rows=ROWS), indent=1, default=str))
    failed = [r for r in ROWS if r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
