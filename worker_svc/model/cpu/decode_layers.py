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

GemmaDecodeLayers does the same for Gemma 3's layers on a GGUF's blocks (the torch
path's family: there is no Python loop of C calls for it, so its output is its torch
layers' to the fused ops' few ulp, not bit for bit; tests/gguf_input/
test_gguf_quantized.py holds it to the exact path's logits). A lone Gemma 3 270M
Q4_K_M step took 26.0 ms through the torch layers and 15.7 ms in one call (the Xeon
VM, two threads): between the torch calls the OpenMP threads fell asleep.
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
from worker_svc.model.layers import MoeWeights

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


@functools.cache
def load_gemma():
    """(Gemma's driver function, int64 tensor of its kernels' addresses), or None."""
    loaded, quant = load(), quant_weights.load()
    if loaded is None or quant is None:
        return None
    lib, ops = native.open_library("decode_layers", FLAGS), fused_ops.load()
    fn = lib.decode_layers_gemma_f32
    fn.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P, _F32, _F32, _I64, _P, _P, _P, _P, _P,
                   _P, _P, _P, _P, _P]
    fn.restype = ctypes.c_int
    fns = loaded[1].clone()
    fns[0], fns[1], fns[5] = 0, quant_weights.address(), _address(ops._gelu_tanh_mul)
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

    def run(self, residual: torch.Tensor, positions: torch.Tensor,
            slot_mapping: torch.Tensor, kv_caches: list, plan: cpu_kernel.PagedDecode,
            cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Runs every layer on residual [rows, hidden] (fp32, contiguous, updated in
        place) and returns the last layer's MLP output, which the caller adds."""
        c, rows = self.cfg, residual.shape[0]
        kv0 = kv_caches[0]
        block_size, num_blocks = kv0.shape[2], kv0.shape[1]
        h, qkv, att, o, gate_up, act, delta = _step_buffers(c, rows)
        attn = torch.tensor(plan.tables(), dtype=torch.int64)
        dims = torch.tensor([len(self._layers), c.hidden_size, c.num_heads, c.num_kv_heads,
                             c.head_dim, c.intermediate_size, cos.shape[0], num_blocks,
                             block_size, *self._flags, torch.get_num_threads()],
                            dtype=torch.int64)
        rc = self._fn(self._fns.data_ptr(), dims.data_ptr(), self._weights.data_ptr(),
                      self._scales.data_ptr(), self._norms.data_ptr(),
                      _kv_pointers(self, kv_caches).data_ptr(), attn.data_ptr(), plan.scale,
                      c.rms_norm_eps, rows, positions.data_ptr(), slot_mapping.data_ptr(),
                      cos.data_ptr(), sin.data_ptr(), residual.data_ptr(), h.data_ptr(),
                      qkv.data_ptr(), att.data_ptr(), o.data_ptr(), gate_up.data_ptr(),
                      act.data_ptr(), delta.data_ptr())
        _raise_for(rc, rows, cos.shape[0], num_blocks * block_size)
        return delta.view(rows, c.hidden_size)


def _step_buffers(c, rows: int) -> list[torch.Tensor]:
    """h, qkv, att, o, gate_up, act and delta for a step of `rows` tokens: one
    allocation, cut into the row-major buffers a C loop writes."""
    nq = c.num_heads * c.head_dim
    widths = (c.hidden_size, nq + 2 * c.num_kv_heads * c.head_dim, nq, c.hidden_size,
              2 * c.intermediate_size, c.intermediate_size, c.hidden_size)
    return torch.empty(rows * sum(widths)).split([rows * w for w in widths])


def _kv_pointers(loop, kv_caches: list) -> torch.Tensor:
    """The addresses of each layer's KV cache, made again only when the caches change."""
    if loop._kv is None or loop._kv[0] is not kv_caches:
        loop._kv = (kv_caches, torch.tensor([c.data_ptr() for c in kv_caches],
                                            dtype=torch.int64))
    return loop._kv[1]


def _raise_for(rc: int, rows: int, num_positions: int, slots: int) -> None:
    """A C loop's failure as the Python loop would raise it."""
    if rc == -1:
        raise ValueError(f"a position beyond {num_positions} or a KV slot beyond {slots}")
    if rc == -2:
        raise MemoryError(f"small_linear_q8: no memory for {rows} rows of int16")
    if rc:  # -3: quant_linear found a malformed weight descriptor
        raise ValueError(f"decode_layers: a matmul failed ({rc})")


class GemmaDecodeLayers:
    """Gemma 3's layers on the quantized path (every matmul a QuantWeight) in one C call
    a decode step (decode_layers_gemma_f32): its norms with (1 + w) made once here, each
    layer's RoPE tables and sliding window. build() returns None where it cannot take
    the model (the compute plan asks it only where it can: compute_plan.py)."""

    def __init__(self, fn, fns: torch.Tensor, cfg, layers, ffn_norms, ropes: list,
                 windows: list) -> None:
        self._fn, self._fns, self.cfg = fn, fns, cfg
        self._weights = torch.tensor([w.desc.data_ptr() for lw in layers
                                      for w in _torch_layer_matmuls(lw)], dtype=torch.int64)
        pre, post = ffn_norms
        # the reference scales by 1 + w in fp32: the same values, added once
        self._one_plus = [(1.0 + t.float()).contiguous()
                          for i, lw in enumerate(layers)
                          for t in (lw.input_norm, lw.post_norm, pre[i], post[i],
                                    lw.q_norm, lw.k_norm)]
        self._norms = torch.tensor([t.data_ptr() for t in self._one_plus], dtype=torch.int64)
        self._ropes = torch.tensor([t.data_ptr() for cos, sin in ropes for t in (cos, sin)],
                                   dtype=torch.int64)
        self._num_positions = ropes[0][0].shape[0]
        self._windows = torch.tensor([w or 0 for w in windows], dtype=torch.int64)
        self._keep = (layers, ropes)  # the tensors those addresses point into stay alive
        self._kv: tuple[list, torch.Tensor] | None = None

    @classmethod
    def build(cls, cfg, layers, ffn_norms, ropes, windows) -> GemmaDecodeLayers | None:
        loaded = load_gemma()
        if loaded is None or not layers or cfg.head_dim > fused_ops.MAX_HEAD_DIM:
            return None
        if not all(isinstance(w, QuantWeight) for lw in layers
                   for w in _torch_layer_matmuls(lw)):
            return None
        if any(lw.q_norm is None or lw.qkv_bias is not None or lw.o_bias is not None
               for lw in layers):
            return None
        if any(t.dtype != torch.float32 or not t.is_contiguous()
               for cos, sin in ropes for t in (cos, sin)):
            return None
        return cls(*loaded, cfg, layers, ffn_norms, ropes, windows)

    def run(self, residual: torch.Tensor, positions: torch.Tensor,
            slot_mapping: torch.Tensor, kv_caches: list, plan: cpu_kernel.PagedDecode
            ) -> torch.Tensor:
        """Runs every layer on residual [rows, hidden] (fp32, contiguous, updated in
        place) and returns the last layer's normed MLP output, which the caller adds."""
        c, rows = self.cfg, residual.shape[0]
        kv0 = kv_caches[0]
        block_size, num_blocks = kv0.shape[2], kv0.shape[1]
        h, qkv, att, o, gate_up, act, delta = _step_buffers(c, rows)
        attn = torch.tensor(plan.tables(), dtype=torch.int64)
        dims = torch.tensor([len(self._keep[0]), c.hidden_size, c.num_heads,
                             c.num_kv_heads, c.head_dim, c.intermediate_size,
                             self._num_positions, num_blocks, block_size,
                             torch.get_num_threads()], dtype=torch.int64)
        rc = self._fn(self._fns.data_ptr(), dims.data_ptr(), self._weights.data_ptr(),
                      self._norms.data_ptr(), self._ropes.data_ptr(), self._windows.data_ptr(),
                      _kv_pointers(self, kv_caches).data_ptr(), attn.data_ptr(), plan.scale,
                      c.rms_norm_eps, rows, positions.data_ptr(), slot_mapping.data_ptr(),
                      residual.data_ptr(), h.data_ptr(), qkv.data_ptr(), att.data_ptr(),
                      o.data_ptr(), gate_up.data_ptr(), act.data_ptr(), delta.data_ptr())
        _raise_for(rc, rows, self._num_positions, num_blocks * block_size)
        return delta.view(rows, c.hidden_size)


def _torch_layer_matmuls(lw) -> tuple:
    """A torch-path layer's qkv, o_proj, gate_up and down (MATMULS' order); Nones for
    routed experts, which no C loop runs."""
    if isinstance(lw.mlp, MoeWeights):
        return lw.qkv, lw.o_proj, None, None
    return lw.qkv, lw.o_proj, lw.mlp.gate_up, lw.mlp.down
