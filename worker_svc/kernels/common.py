"""Pieces shared by the attention kernels: tile sizes, dot precision, and the
paged-cache address of a run of token positions."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp2 is one instruction on a GPU


def dot_settings(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """(upcast operands to fp32 before tl.dot, input precision).

    fp32 must not silently drop to tf32 (1e-3 error), so it asks for "ieee".
    Tensors on the CPU mean the Triton interpreter, which computes bf16 math wrongly,
    so there bf16 operands go through fp32; on a GPU bf16/fp16 operands feed the
    tensor cores directly."""
    if dtype == torch.float32:
        return False, "ieee"
    if dtype == torch.bfloat16 and device.type == "cpu":
        return True, "ieee"
    return False, "tf32"  # ignored for 16-bit operands


def check_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def output_for(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A fresh contiguous output (the model views it as [tokens, hidden]), or the
    caller's buffer if it fits."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match query "
                         f"{tuple(query.shape)} {query.dtype} with a contiguous last axis")
    return out


def block_d(head_dim: int) -> int:
    # tl.arange needs a power of two and tl.dot needs at least 16
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def paged_offsets(block_table_row, positions, mask, stride_block, stride_slot,
                  PAGE: tl.constexpr):
    """Element offset (int64: caches exceed 2**31 elements) of each position's slot."""
    page = tl.load(block_table_row + positions // PAGE, mask=mask, other=0).to(tl.int64)
    return page * stride_block + (positions % PAGE).to(tl.int64) * stride_slot


NO_WINDOW = 1 << 30  # the window argument of a layer without one: wider than any context


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), tanh through exp2 (saturates cleanly at +-1)."""
    e = tl.exp2(s * (2.8853900817779268 / cap))  # exp(2 s / cap): 2.885... = 2 log2(e)
    return cap * (1.0 - 2.0 / (e + 1.0))
