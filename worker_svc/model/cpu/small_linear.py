"""The small-batch matmul of CPU decode steps (worker_svc/csrc/small_linear.c).

A step of one to a few tokens streams every weight once: memory bandwidth bounds it.
oneDNN's prepacked GEMM, which wins for wide batches, moves about half the bytes per
second this kernel does at one to four rows and is still slower at eight
(docs/worker.md), so the worker keeps a plain row-major copy of each matmul weight
beside the prepacked one and runs steps of at most MAX_ROWS tokens here. That copy
costs the matmul weights' bytes once more (for a tied vocabulary projection the
embedding table is it: nothing more).

--quantization int8 makes that copy int8 with one fp32 scale per GROUP inputs of a
row (Int8Weight; llama.cpp's Q8_0 grouping): a quarter of fp32's bytes, so steps of a
few tokens (a lone stream's decodes) run about twice as fast, at int8's rounding, and
steps of up to INT8_MAX_ROWS tokens (a short prompt's prefill, up to 32 concurrent
decodes) read them too; wider steps (long prefill, big batches) keep the --dtype
weights and their accuracy.

--no-cpu-small-batch keeps every step on oneDNN (and no copies); without a compiler
`load()` is None and the same happens. The compute plan (worker_svc/compute_plan.py)
decides, once: which copies, and up to how many rows (MAX_ROWS, INT8_MAX_ROWS).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from worker_svc import native
from worker_svc.model.cpu import quant_weights
from worker_svc.model.cpu.quant_weights import QuantWeight

FLAGS = ("-fopenmp",)
# The largest step (in token rows) the kernel takes: past it, each weight byte feeds
# enough multiply-adds that oneDNN's blocked GEMM wins. benchmarks/small_linear.py on
# the Zen 3 (AVX2), the model's fp32 matmuls: 6 rows 53.8 against oneDNN's 63.0 ms,
# 8 rows 64.4 against 70.8, 12 rows 93.6 against 84.2 (docs/worker.md). With 4 here
# (steps of 5-8 rows on oneDNN), a worker step of 6 decodes took 78.0 ms (48.1 now),
# with --quantization int8 85.1 (27.0 now).
MAX_ROWS = 8
# With --quantization int8 the kernel reads a quarter of the bytes and keeps winning
# longer: the model's matmuls, int8 kernel against oneDNN's packed fp32 (Zen 3, 5
# alternations): 8 rows 25.7 against 68.3 ms, 12 rows 39.3 against 78.7, 16 49.3
# against 94.7, 32 94.1 against 116.9. So int8 copies serve steps of up to 32 tokens:
# the prefill of a short prompt (a chat turn) and up to 32 concurrent decodes.
INT8_MAX_ROWS = 32
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
        if isinstance(weight, QuantWeight):  # a GGUF's blocks: their own kernel
            return quant_weights.load()(x, weight, bias)
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


def supports(weight: torch.Tensor | Int8Weight | QuantWeight) -> bool:
    if isinstance(weight, QuantWeight):
        return quant_weights.load() is not None
    if isinstance(weight, Int8Weight):
        return (weight.q.device.type == "cpu" and weight.q.is_contiguous()
                and weight.scales.is_contiguous() and weight.shape[1] % GROUP == 0)
    return (weight.device.type == "cpu" and not weight.is_mkldnn and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous())


@functools.cache
def load() -> SmallLinear | None:
    lib = native.open_library("small_linear", FLAGS)
    return None if lib is None else SmallLinear(lib)


# ---- greedy rows: the vocabulary projection screened by its int8 copy -------------
#
# A greedy row with nothing that changes its logits (no penalties, bias, min_tokens
# or logprobs) needs only the index of its largest logit. Steps of a few rows are
# bound by the bytes of the projection (49152 x 576 fp32: 113 MB, a fifth of the
# model), so such rows first take the projection through an int8 copy (32 MB) with a
# proven bound on each logit's error, then compute exactly, with the same kernel and
# weights as the full projection, only the rows whose bound lets them be the largest.
# The argmax is the full projection's, bit for bit (each output of the kernel depends
# only on its weight row and x, not on which other rows are computed or how many x
# rows there are); every other logit is -inf.
#
# The bound, per x row and vocabulary row r with group scales s_g of the int8 copy:
# |approx_r - exact_r| <= factor * D_r, D_r = sum_g s_g * ||x_g||_1, where factor adds
#   1/2          the int8 rounding of each weight (at most s_g / 2 per weight),
#   0.0621       x as int16 in the int8 kernel (127 * 32 / (2 * 32767) of s_g max|x_g|),
#   (in+G+8)u128 fp32 rounding of both kernels' sums (|w| <= 127.5 s_g, u = 2^-24),
# times 1.05 for the rounding of the bound itself. A row can be the argmax only if
# approx_r + eps_r >= approx_top - eps_top.
SCREEN_MAX_CANDIDATES = 4096  # past this a row's logits are too flat: the full projection


def screen_factor(in_features: int) -> float:
    groups = in_features // GROUP
    return 1.05 * (0.5 + 127 * 32 / (2 * 32767) + (in_features + groups + 8) * 2**-24 * 128)


def screened_argmax_logits(kernel: SmallLinear, x: torch.Tensor, approx: Int8Weight,
                           exact: torch.Tensor) -> torch.Tensor | None:
    """[rows, vocab] logits that hold, wherever a row's argmax can be, exactly what
    kernel(x, exact) gives there, and -inf elsewhere; None when a row leaves more than
    SCREEN_MAX_CANDIDATES candidates or x is not finite (the caller then projects in
    full)."""
    rows, inp = x.shape
    screen = kernel(x, approx)
    l1 = x.abs().reshape(rows, inp // GROUP, GROUP).sum(-1)
    eps = torch.mm(l1, approx.scales.T).mul_(screen_factor(inp))
    top = screen.argmax(dim=-1, keepdim=True)
    floor = screen.gather(1, top) - eps.gather(1, top)
    if not bool(torch.isfinite(floor).all()):
        return None
    candidates = screen.add_(eps) >= floor
    ids = [c.nonzero().squeeze(1) for c in candidates]
    if max(len(i) for i in ids) > SCREEN_MAX_CANDIDATES:
        return None
    out = torch.full((rows, exact.shape[0]), float("-inf"))
    for r, i in enumerate(ids):
        out[r, i] = kernel(x[r:r + 1], exact.index_select(0, i))[0]
    return out
