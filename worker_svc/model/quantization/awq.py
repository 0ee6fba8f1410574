"""AWQ, GEMM version (AutoAWQ): int32 `qweight` [in, out / 8] and `qzeros`
[groups, out / 8] packing 4-bit codes along the output dimension in AutoAWQ's
interleaved order, fp16 `scales` [groups, out]; weight = (q - zero) * scale per group
of group_size input columns. GEMV and other versions pack differently: refused."""

from __future__ import annotations

from pathlib import Path

import torch

from worker_svc.model.quantization import QuantMethod, refuse, unpack_int32

# nibble i of each int32 holds column ORDER[i] of its 8 (AutoAWQ's pack order)
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    raw = unpack_int32(packed, 4, -1).view(packed.shape[0], -1, 8)
    out = torch.empty_like(raw)
    out[:, :, ORDER] = raw
    return out.view(packed.shape[0], -1)


class Awq(QuantMethod):
    name = "awq"
    suffixes = frozenset({"qweight", "qzeros", "scales"})

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def shape(self, entries, read) -> tuple[int, int]:
        inp, cols = entries["qweight"].shape
        return cols * 8, inp

    def dequantize(self, prefix: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        q, z, s = _unpack(t["qweight"]), _unpack(t["qzeros"]), t["scales"].float()
        g = torch.arange(q.shape[0]) // self.group_size
        return ((q.float() - z[g].float()) * s[g]).T.contiguous()


def from_config(model_dir: Path, d: dict) -> Awq:
    version, bits = str(d.get("version", "gemm")).lower(), d.get("bits", d.get("w_bit"))
    group = d.get("group_size", d.get("q_group_size"))
    if version != "gemm" or bits != 4 or not d.get("zero_point", True) or not group:
        raise refuse(model_dir, f"awq version={version!r} bits={bits!r} "
                                f"zero_point={d.get('zero_point', True)!r}")
    return Awq(int(group))
