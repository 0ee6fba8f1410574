"""compressed-tensors (llm-compressor's format): int8 W8A8, FP8 per-channel and
per-tensor ("int-quantized", "float-quantized", "naive-quantized": the codes stored as
`weight`) and W4A16/W8A16 "pack-quantized" (codes packed into int32 `weight_packed`).
Dequantized as compressed-tensors' own decompressors do: (q - zero_point) * scale,
the scale per tensor, per output row or per group of input columns. Activation
quantization (input_activations) belongs to a fast path; the exact one keeps floats."""

from __future__ import annotations

from pathlib import Path

import torch

from worker_svc.model.quantization import QuantMethod, refuse, unpack_int32

FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")
STRATEGIES = ("tensor", "channel", "group")


class CompressedTensors(QuantMethod):
    name = "compressed-tensors"
    suffixes = frozenset({"weight_scale", "weight_zero_point", "weight_packed",
                          "weight_shape", "input_scale", "input_zero_point"})

    def __init__(self, fmt: str, bits: int, group_size: int | None) -> None:
        self.fmt, self.bits, self.group_size = fmt, bits, group_size

    def shape(self, entries, read) -> tuple[int, int]:
        if "weight_shape" in entries:
            return tuple(int(x) for x in read("weight_shape").tolist())
        return tuple(entries["weight"].shape)

    def dequantize(self, prefix: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        scale = t["weight_scale"].float()
        if "weight_packed" in t:
            out, inp = (int(x) for x in t["weight_shape"].tolist())
            q = unpack_int32(t["weight_packed"], self.bits, -1)[:, :inp].float()
            q = q - (1 << (self.bits - 1))  # stored offset by half the range
        else:
            q = t["weight"].float()
            out, inp = q.shape
        zp = t.get("weight_zero_point")
        return _broadcast(scale, out, inp) * (q - (0 if zp is None else
                                                    _broadcast(zp.float(), out, inp)))


def _broadcast(s: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """A per-tensor, per-row [out, 1] or per-group [out, groups] tensor as [out, in]."""
    if s.numel() == 1:
        return s.reshape(1, 1)
    s = s.reshape(out, -1)
    if s.shape[1] == 1:
        return s
    group = -(-inp // s.shape[1])
    return s.repeat_interleave(group, dim=1)[:, :inp]


def from_config(model_dir: Path, d: dict) -> CompressedTensors:
    groups = d.get("config_groups") or {}
    top_fmt = d.get("format")
    if d.get("sparsity_config"):
        raise refuse(model_dir, "compressed-tensors with a sparsity_config")
    if len(groups) != 1:
        raise refuse(model_dir, f"compressed-tensors with {len(groups)} config_groups")
    (group,) = groups.values()
    fmt = group.get("format") or top_fmt
    w = group.get("weights") or {}
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    what = f"compressed-tensors format={fmt!r} weights {kind} {bits}-bit {strategy}"
    ok = (fmt in FORMATS and strategy in STRATEGIES
          and ((fmt == "pack-quantized" and kind == "int" and bits in (4, 8)
                and w.get("symmetric", True))
               or (fmt == "float-quantized" and kind == "float" and bits == 8)
               or (fmt in ("int-quantized", "naive-quantized") and kind == "int" and bits == 8)))
    if not ok or w.get("dynamic") or w.get("actorder") not in (None, "static", "weight"):
        raise refuse(model_dir, what)
    return CompressedTensors(fmt, bits, w.get("group_size"))
