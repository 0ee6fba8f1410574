"""Compile every kernel for an NVIDIA GPU without one: Triton's front end, LLVM and
the bundled ptxas run on the CPU. This catches what the interpreter lets through
(tl.dot below 16, type errors, shared memory past the card's limit, register
spills at the model dtype) before a GPU
ever sees the code. Run without TRITON_INTERPRET; prints one line per kernel.

    python tests/kernels/gpu_compile.py [sm]  (default 90: H100/H200)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compiling needs the real JIT"

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

from worker_svc.kernels import decode, kv_write, prefill  # noqa: E402

CUDA = torch.device("cuda")
SMEM_LIMIT = 227 * 1024  # per block on sm_90
POINTERS = {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
            "slot_ptr": "*i64", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def signature(fn, constexprs: dict, dtype: torch.dtype) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = POINTERS.get(name, "*" + DTYPES[dtype])
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


def divisibility(fn, constexprs: dict) -> dict:
    """The hints the JIT would give at model shapes: 16-byte aligned pointers and
    strides that are multiples of 16 (every stride is a multiple of a head dim of 64
    or 128), except the block table's row length and the split count."""
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs or name in ("qk_scale", "stride_bt_req", "num_splits"):
            continue
        attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def builds(dtype: torch.dtype, group: int, head_dim: int, num_kv_heads: int, page: int = 16):
    """(name, kernel, constexprs, launch options) exactly as the launchers choose them."""
    yield ("decode", decode._decode_kernel,
           decode.decode_constexprs(group, head_dim, page, 1, 64, dtype, CUDA), decode.LAUNCH)
    yield ("decode_split", decode._decode_kernel,
           decode.decode_constexprs(group, head_dim, page, 8, 64, dtype, CUDA), decode.LAUNCH)
    yield ("merge_splits", decode._merge_splits_kernel,
           decode.merge_constexprs(group * num_kv_heads, head_dim, 8), decode.LAUNCH)
    yield ("prefill", prefill._prefill_kernel,
           prefill.prefill_constexprs(group, head_dim, page, 64, 64, dtype, CUDA),
           prefill.LAUNCH)
    yield ("kv_write", kv_write._kv_write_kernel,
           kv_write.kv_write_constexprs(num_kv_heads, head_dim, page), dict(num_warps=4))


def spill_bytes(ptx: str, sm: int) -> int:
    """Register spill stores ptxas reports for the kernel (0 = it fits in registers)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch = f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"  # 'a': Hopper's wgmma/TMA features
        log = subprocess.run([get_ptxas(sm).path, "-v", f"--gpu-name={arch}", src, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True,
                             check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


def main(sm: int = 90) -> None:
    target = GPUTarget("cuda", sm, 32)
    # the largest shape: the default model's (9/3 heads, d64) needs fewer registers
    # and less shared memory with the same code
    shapes = [("llama-8b 32/8 d128", torch.bfloat16, 4, 128, 8)]
    for label, dtype, group, head_dim, kv_heads in shapes:
        for name, fn, consts, options in builds(dtype, group, head_dim, kv_heads):
            src = ASTSource(fn, signature(fn, consts, dtype), constexprs=consts,
                            attrs=divisibility(fn, consts))
            kernel = triton_compile(src, target=target, options=dict(options))
            smem = kernel.metadata.shared
            assert "cubin" in kernel.asm, f"{name}: no cubin"
            assert smem <= SMEM_LIMIT, f"{name}: {smem} bytes of shared memory"
            spills = spill_bytes(kernel.asm["ptx"], sm)
            assert spills == 0, f"{name}: {spills} bytes of register spills"
            print(f"ok {label} {DTYPES[dtype]} {name}: smem {smem} B, no spills")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
