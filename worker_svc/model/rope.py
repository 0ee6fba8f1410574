"""Rotary position tables and their application, shared by every family."""

from __future__ import annotations

import torch


def rope_tables(inv_freq: torch.Tensor, scaling: float, max_positions: int,
                long_inv_freq: torch.Tensor | None = None, long_from: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, 2 * len(inv_freq)] in fp32, as the reference computes
    them, times `scaling` (yarn's or longrope's attention factor). Positions from
    long_from on rotate with long_inv_freq (longrope, model/phi3.py). The sign of
    rotate_half is folded into sin: rotate_half(x) == roll(x, half) * [-1.., +1..]."""
    positions = torch.arange(max_positions, dtype=torch.float).unsqueeze(1)
    freqs = positions * inv_freq
    if long_inv_freq is not None and long_from < max_positions:
        freqs[long_from:] = positions[long_from:] * long_inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    half = inv_freq.shape[0]
    sign = torch.cat((-torch.ones(half), torch.ones(half)))
    return emb.cos() * scaling, emb.sin() * scaling * sign


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] with cos/sin [..., rotary_dim] (sign folded into sin): the first
    rotary_dim dims rotated, the rest passed through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(rotary_dim // 2, dims=-1), sin)
    rot = x[..., :rotary_dim]
    rot = torch.addcmul(rot * cos, rot.roll(rotary_dim // 2, dims=-1), sin)
    return torch.cat((rot, x[..., rotary_dim:]), dim=-1)
