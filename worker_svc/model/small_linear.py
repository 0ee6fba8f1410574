"""The small-batch matmul of CPU decode steps (worker_svc/csrc/small_linear.c).

A step of one to a few tokens streams every weight once: memory bandwidth bounds it.
oneDNN's prepacked GEMM, which wins for wide batches, moves about half the bytes per
second this kernel does at one to four rows (docs/benchmarks.md), so the worker keeps
a plain row-major copy of each matmul weight beside the prepacked one and runs steps
of at most MAX_ROWS tokens here. That copy costs the matmul weights' bytes once more
(for a tied vocabulary projection the embedding table is it: nothing more).

--quantization int8 makes that copy int8 with one fp32 scale per GROUP inputs of a
row (Int8Weight; llama.cpp's Q8_0 grouping): a quarter of fp32's bytes, so steps of a
few tokens (a lone stream's decodes) run about twice as fast, at int8's rounding;
wider steps (prefill, big batches) keep the --dtype weights and their accuracy.

GAPSERVE_CPU_SMALL_BATCH=off keeps every step on oneDNN (and no copies); without a
compiler `load()` is None and the same happens.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch

from worker_svc import native

FLAGS = ("-fopenmp",)
# The largest step (in token rows) the kernel takes: past it, each weight byte feeds
# enough multiply-adds that oneDNN's blocked GEMM wins (benchmarks/small_linear.py:
# fp32 at 4 rows 23.9 against 33.2 ms for the model's matmuls, at 8 rows 43.8 against
# 38.0; docs/benchmarks.md).
MAX_ROWS = 4
GROUP = 32  # Q8_GROUP in small_linear.c: inputs sharing one int8 scale
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A matmul weight [out, in] as int8 q [out, in] and fp32 scales [out, in / GROUP]:
    w[o, i] ~= q[o, i] * scales[o, i // GROUP], |error| <= scale / 2."""
    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, self.scales

    def dequantize(self) -> torch.Tensor:
        out, inp = self.q.shape
        return (self.q.float().view(out, inp // GROUP, GROUP)
                * self.scales.unsqueeze(-1)).view(out, inp)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric int8 per GROUP inputs of each row, the scale max|w| / 127 of its group
    (an all-zero group gets scale 0 and zeros)."""
    out, inp = w.shape
    if inp % GROUP:
        raise ValueError(f"--quantization int8 needs input features that are a multiple "
                         f"of {GROUP}; a weight of shape {tuple(w.shape)} is not")
    g = w.detach().float().reshape(out, inp // GROUP, GROUP)
    scales = g.abs().amax(dim=-1) / 127.0
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    q = torch.round(g / divisor).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.reshape(out, inp).contiguous(), scales.contiguous())


class SmallLinear:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.small_linear_f32
        self._fn.argtypes = [_P, _I64, _I64, _P, ctypes.c_int, _I64, _I64, _P, ctypes.c_int]
        self._fn.restype = None
        self._q8 = lib.small_linear_q8
        self._q8.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, ctypes.c_int]
        self._q8.restype = ctypes.c_int

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] fp32 (rows with unit element stride) @ weight.T [out, in] (fp32
        or bf16, contiguous, or an Int8Weight) + bias, as fp32 [rows, out]."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, (out, inp) = x.shape[0], weight.shape
        y = torch.empty(rows, out, dtype=torch.float32)
        if rows and isinstance(weight, Int8Weight):
            if self._q8(x.data_ptr(), x.stride(0), rows, weight.q.data_ptr(),
                        weight.scales.data_ptr(), out, inp, y.data_ptr(),
                        torch.get_num_threads()):
                raise MemoryError(f"small_linear_q8: no memory for {rows} x {inp} int16")
        elif rows:
            self._fn(x.data_ptr(), x.stride(0), rows, weight.data_ptr(),
                     int(weight.dtype == torch.bfloat16), out, inp,
                     y.data_ptr(), torch.get_num_threads())
        if bias is not None:
            y += bias
        return y


def supports(weight: torch.Tensor | Int8Weight) -> bool:
    if isinstance(weight, Int8Weight):
        return (weight.q.device.type == "cpu" and weight.q.is_contiguous()
                and weight.scales.is_contiguous() and weight.shape[1] % GROUP == 0)
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
