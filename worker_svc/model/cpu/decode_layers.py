"""Every decoder layer of a small CPU decode step in one C call (csrc/decode_layers.c).

A decode step of one to a few tokens runs about ten C kernels a layer. Called from
the Python loop (DecoderModel._forward_fused), each pays a ctypes call, an output
allocation and the interpreter between calls: about 7 us a call measured here, some
270 calls a step; on the default model an int8 step of one token took 15.7 ms that
way and 11.7 ms in one call (the Zen 3 VM, docs/worker.md). The C loop calls the same kernels
(function pointers into their own libraries) in the same order into buffers made once
a step, so its output is the Python loop's bit for bit, without that overhead.

It takes a step when every piece is the C one: fp32 activations on CPU, the fused
element-wise ops, the small-batch matmul kernel (fp32, bf16 or int8 weights), the C
decode attention kernel serving every row (all rows single-token decodes), no tensor
parallelism and no matmul biases: the compute plan (worker_svc/compute_plan.py)
decides that once at start. Anything else runs the Python loop, as does
--no-cpu-decode-layers.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from worker_svc import native
from worker_svc.attention import cpu_kernel
from worker_svc.model.cpu import fused_ops, quant_weights, small_linear
from worker_svc.model.cpu.quant_weights import QuantWeight
from worker_svc.model.cpu.cpu_dtype import LINEARS

FLAGS: tuple[str, ...] = ()  # no arithmetic of its own: the kernels keep their flags
_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MATMULS = tuple(n for n in LINEARS if not n.endswith("bias"))  # in the C loop's order
BIASES = tuple(n for n in LINEARS if n.endswith("bias"))


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def load():
    """(the driver function, int64 tensor of the kernels' addresses), or None."""
    small, ops, attention = small_linear.load(), fused_ops.load(), cpu_kernel.load()
    lib = native.open_library("decode_layers", FLAGS)
    if None in (small, ops, attention, lib):
        return None
    fn = lib.decode_layers_f32
    fn.argtypes = [_P, _P, _P, _P, _P, _P, _P, _F32, _F32, _I64, _P, _P, _P, _P, _P,
                   _P, _P, _P, _P, _P, _P, _P]
    fn.restype = ctypes.c_int
    fns = torch.tensor([_address(f) for f in (
        small._fn, small._q8, ops._rms_norm, ops._add_rms_norm, ops._rope_write_kv,
        ops._silu_mul, attention.paged_decode_f32)], dtype=torch.int64)
    return fn, fns


class DecodeLayers:
    """The C loop bound to one model's weights; build() returns None where it cannot
    take that model's small steps at all."""

    def __init__(self, fn, fns: torch.Tensor, cfg, layers, dtype_int8: bool,
                 dtype_bf16: bool) -> None:
        self._fn, self._fns, self.cfg = fn, fns, cfg
        ptr = lambda t: t.data_ptr()  # noqa: E731
        quant = isinstance(layers[0].qkv, QuantWeight)
        if quant:  # quant_linear in small_linear_q8's place, the descriptor for the rows
            self._fns = fns = fns.clone()
            fns[1] = quant_weights.address()
            dtype_int8 = True
        self._weights = torch.tensor(
            [ptr(w.desc) if quant else ptr(w.q) if dtype_int8 else ptr(w) for lw in layers
             for w in (getattr(lw, n) for n in MATMULS)], dtype=torch.int64)
        self._scales = torch.tensor(
            [ptr(getattr(lw, n).scales) if dtype_int8 and not quant else 0 for lw in layers
             for n in MATMULS], dtype=torch.int64)
        self._norms = torch.tensor([ptr(t) for lw in layers
                                    for t in (lw.input_norm, lw.post_norm)], dtype=torch.int64)
        self._flags = (int(dtype_int8), int(dtype_bf16))
        self._layers = layers  # the tensors those addresses point into stay alive
        self._kv: tuple[list, torch.Tensor] | None = None

    @classmethod
    def build(cls, cfg, layers, tp) -> DecodeLayers | None:
        loaded = load()
        if loaded is None or tp is not None or not layers:
            return None
        if any(getattr(lw, b, None) is not None for lw in layers for b in BIASES):
            return None
        first = layers[0].qkv
        if isinstance(first, QuantWeight):
            if all(isinstance(getattr(lw, n), QuantWeight) for lw in layers for n in MATMULS) \
                    and quant_weights.load() is not None:
                return cls(*loaded, cfg, layers, False, False)
            return None
        int8 = isinstance(first, small_linear.Int8Weight)
        bf16 = not int8 and first.dtype == torch.bfloat16
        for lw in layers:
            for n in MATMULS:
                w = getattr(lw, n)
                if not small_linear.supports(w) or isinstance(w, small_linear.Int8Weight) != int8:
                    return None
                if not int8 and (w.dtype == torch.bfloat16) != bf16:
                    return None
            if not (lw.input_norm.is_contiguous() and lw.post_norm.is_contiguous()
                    and lw.input_norm.dtype == torch.float32):
                return None
        return cls(*loaded, cfg, layers, int8, bf16)

    def _kv_pointers(self, kv_caches: list) -> torch.Tensor:
        if self._kv is None or self._kv[0] is not kv_caches:
            self._kv = (kv_caches, torch.tensor([c.data_ptr() for c in kv_caches],
                                                dtype=torch.int64))
        return self._kv[1]

    def run(self, residual: torch.Tensor, positions: torch.Tensor,
            slot_mapping: torch.Tensor, kv_caches: list, plan: cpu_kernel.PagedDecode,
            cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Runs every layer on residual [rows, hidden] (fp32, contiguous, updated in
        place) and returns the last layer's MLP output, which the caller adds."""
        c, rows = self.cfg, residual.shape[0]
        kv0 = kv_caches[0]
        block_size, num_blocks = kv0.shape[2], kv0.shape[1]
        nq = c.num_heads * c.head_dim
        qkv_width = nq + 2 * c.num_kv_heads * c.head_dim
        # one allocation, cut into the row-major buffers the loop writes
        widths = (c.hidden_size, qkv_width, nq, c.hidden_size, 2 * c.intermediate_size,
                  c.intermediate_size, c.hidden_size)
        buf = torch.empty(rows * sum(widths))
        h, qkv, att, o, gate_up, act, delta = buf.split([rows * w for w in widths])
        attn = torch.tensor(plan.tables(), dtype=torch.int64)
        dims = torch.tensor([len(self._layers), c.hidden_size, c.num_heads, c.num_kv_heads,
                             c.head_dim, c.intermediate_size, cos.shape[0], num_blocks,
                             block_size, *self._flags, torch.get_num_threads()],
                            dtype=torch.int64)
        rc = self._fn(self._fns.data_ptr(), dims.data_ptr(), self._weights.data_ptr(),
                      self._scales.data_ptr(), self._norms.data_ptr(),
                      self._kv_pointers(kv_caches).data_ptr(), attn.data_ptr(), plan.scale,
                      c.rms_norm_eps, rows, positions.data_ptr(), slot_mapping.data_ptr(),
                      cos.data_ptr(), sin.data_ptr(), residual.data_ptr(), h.data_ptr(),
                      qkv.data_ptr(), att.data_ptr(), o.data_ptr(), gate_up.data_ptr(),
                      act.data_ptr(), delta.data_ptr())
        if rc == -1:
            raise ValueError(f"a position beyond {cos.shape[0]} or a KV slot beyond "
                             f"{num_blocks * block_size}")
        if rc == -2:
            raise MemoryError(f"small_linear_q8: no memory for {rows} rows of int16")
        if rc:  # -3: quant_linear found a malformed weight descriptor
            raise ValueError(f"decode_layers: a matmul failed ({rc})")
        return delta.view(rows, c.hidden_size)
