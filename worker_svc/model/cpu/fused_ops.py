"""The C element-wise ops of a decoder layer (worker_svc/csrc/decoder_ops.c), fp32 CPU.

At batch 1 a layer's matrix multiplies take ~0.8 ms and its ~20 small torch ops
(norms, RoPE, KV write, residual adds, SiLU·up) another ~0.3 ms of dispatch and allocation;
these calls do the small ones in four C calls per layer. Loaded with ctypes.PyDLL:
the calls are microseconds long, so they keep the GIL rather than hand it to the
gRPC threads and wait to get it back. The compute plan (worker_svc/compute_plan.py)
gives them to fp32 CPU models of head_dim up to MAX_HEAD_DIM when they build; without
a compiler, for other dtypes or devices, or with --no-cpu-fused-ops the model keeps
its torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from worker_svc import native

# no fused multiply-adds: each product and sum rounds where the reference rounds it
FLAGS = ("-ffp-contract=off",)
MAX_HEAD_DIM = 512  # the kernel's scratch for one rotated head
# the C ops run on one thread: up to a 2048-token step they beat torch's (1.5 vs 1.8 s
# at 1024 prefill tokens here), at 4096 torch's two threads win (10.3 vs 10.7 s)
MAX_TOKENS = 2048
_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class FusedOps:
    def __init__(self, lib: ctypes.PyDLL) -> None:
        self._rms_norm = lib.rms_norm_f32
        self._rms_norm.argtypes = [_P, _I64, _P, _P, _I64, _I64, _F32]
        self._add_rms_norm = lib.add_rms_norm_f32
        self._add_rms_norm.argtypes = [_P, _P, _P, _P, _I64, _I64, _F32]
        self._rope_write_kv = lib.rope_write_kv_f32
        self._rope_write_kv.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64,
                                        _P, _I64, _P]
        self._rope_write_kv.restype = ctypes.c_int
        self._silu_mul = lib.silu_mul_f32
        self._silu_mul.argtypes = [_P, _P, _I64, _I64]
        self._gelu_tanh_mul = lib.gelu_tanh_mul_f32
        self._gelu_tanh_mul.argtypes = [_P, _P, _I64, _I64]
        for fn in (self._rms_norm, self._add_rms_norm, self._silu_mul, self._gelu_tanh_mul):
            fn.restype = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x) of each row of x [rows, dim] (rows may be strided)."""
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)
        self._rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                       x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += delta in place; returns rms_norm(residual). Both contiguous."""
        out = torch.empty_like(residual)
        self._add_rms_norm(residual.data_ptr(), delta.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), residual.shape[0], residual.shape[1], eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [rows, 2 * inter] (contiguous) -> [rows, inter]."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter)
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up of gate_up [rows, 2 * inter] (contiguous) -> [rows, inter]
        (Gemma's GeGLU; within a few ulp of torch's)."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        self._gelu_tanh_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter)
        return out

    def rope_write_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """RoPE on qkv's q and k heads in place, then k and v into their cache slots.
        qkv [rows, (heads + 2 * kv_heads) * head_dim] contiguous; cos/sin the model's
        [max_positions, head_dim] tables; positions and slot_mapping int64 [rows].
        A position or slot out of range raises ValueError and writes nothing."""
        if self._rope_write_kv(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads,
                               num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                               positions.data_ptr(), cos.shape[0], kv_cache.data_ptr(),
                               kv_cache.shape[1] * kv_cache.shape[2],
                               slot_mapping.data_ptr()):
            raise ValueError(f"a position beyond {cos.shape[0]} or a KV slot beyond "
                             f"{kv_cache.shape[1] * kv_cache.shape[2]}")


def takes(input_ids: torch.Tensor, positions: torch.Tensor,
          slot_mapping: torch.Tensor) -> bool:
    """Whether a step can run the C ops: not too many tokens, and the int64 contiguous
    positions and slots the C side indexes with (the runner builds them so)."""
    return (input_ids.shape[0] <= MAX_TOKENS
            and all(t.dtype == torch.int64 and t.is_contiguous()
                    for t in (positions, slot_mapping)))


@functools.cache
def load() -> FusedOps | None:
    lib = native.open_library("decoder_ops", FLAGS, ctypes.PyDLL)
    return None if lib is None else FusedOps(lib)
