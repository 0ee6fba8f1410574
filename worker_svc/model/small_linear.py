"""The small-batch matmul of CPU decode steps (worker_svc/csrc/small_linear.c).

A step of one to a few tokens streams every weight once: memory bandwidth bounds it.
oneDNN's prepacked GEMM, which wins for wide batches, moves about half the bytes per
second this kernel does at one to four rows (docs/benchmarks.md), so the worker keeps
a plain row-major copy of each matmul weight beside the prepacked one and runs steps
of at most MAX_ROWS tokens here. That copy costs the matmul weights' bytes once more
(for a tied vocabulary projection the embedding table is it: nothing more).

GAPSERVE_CPU_SMALL_BATCH=off keeps every step on oneDNN (and no copies); without a
compiler `load()` is None and the same happens.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from worker_svc import native

FLAGS = ("-fopenmp",)
# The largest step (in token rows) the kernel takes: past it, each weight byte feeds
# enough multiply-adds that oneDNN's blocked GEMM wins (benchmarks/small_linear.py:
# fp32 at 4 rows 23.9 against 33.2 ms for the model's matmuls, at 8 rows 43.8 against
# 38.0; docs/benchmarks.md).
MAX_ROWS = 4
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class SmallLinear:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.small_linear_f32
        self._fn.argtypes = [_P, _I64, _I64, _P, ctypes.c_int, _I64, _I64, _P, ctypes.c_int]
        self._fn.restype = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] fp32 (rows with unit element stride) @ weight.T [out, in] (fp32
        or bf16, contiguous) + bias, as fp32 [rows, out]."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, out = x.shape[0], weight.shape[0]
        y = torch.empty(rows, out, dtype=torch.float32)
        if rows:
            self._fn(x.data_ptr(), x.stride(0), rows, weight.data_ptr(),
                     int(weight.dtype == torch.bfloat16), out, weight.shape[1],
                     y.data_ptr(), torch.get_num_threads())
        if bias is not None:
            y += bias
        return y


def supports(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and not weight.is_mkldnn and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous())


@functools.cache
def load() -> SmallLinear | None:
    path = native.build("small_linear", FLAGS)
    if path is None:
        return None
    try:
        return SmallLinear(ctypes.CDLL(str(path)))
    except OSError:
        return None


def active(act_dtype: torch.dtype, device: torch.device) -> SmallLinear | None:
    """The kernel for fp32 activations on CPU (fp32 or bf16 weights), or None."""
    if os.environ.get("GAPSERVE_CPU_SMALL_BATCH", "") == "off":
        return None
    if act_dtype != torch.float32 or device.type != "cpu":
        return None
    return load()
