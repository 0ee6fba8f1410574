"""GPTQ (AutoGPTQ/GPTQModel): int32 `qweight` [in / (32/bits), out] packing codes
along the input dimension, `qzeros` [groups, out / (32/bits)] along the output,
fp16 `scales` [groups, out], and with desc_act a `g_idx` [in] giving each input
column's group. Dequantized as their reference does: scale * (q - (zero + 1)) for the
original "gptq" checkpoint format (zeros stored one less), scale * (q - zero) for
"gptq_v2"."""

from __future__ import annotations

from pathlib import Path

import torch

from worker_svc.model.quantization import QuantMethod, refuse, unpack_int32


class Gptq(QuantMethod):
    name = "gptq"
    suffixes = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    def __init__(self, bits: int, group_size: int, zero_offset: int) -> None:
        self.bits, self.group_size, self.zero_offset = bits, group_size, zero_offset

    def shape(self, entries, read) -> tuple[int, int]:
        rows, out = entries["qweight"].shape
        return out, rows * (32 // self.bits)

    def dequantize(self, prefix: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        q = unpack_int32(t["qweight"], self.bits, 0)  # [in, out]
        z = unpack_int32(t["qzeros"], self.bits, -1)[:, :q.shape[1]]  # [groups, out]
        s = t["scales"].float()
        inp = q.shape[0]
        if "g_idx" in t:
            g = t["g_idx"].long()
        else:
            g = torch.arange(inp) // (self.group_size if self.group_size > 0 else inp)
        w = s[g] * (q.float() - (z[g].float() + self.zero_offset))
        return w.T.contiguous()


def from_config(model_dir: Path, d: dict) -> Gptq:
    bits, fmt = d.get("bits"), d.get("checkpoint_format", "gptq")
    if bits not in (2, 4, 8) or fmt not in ("gptq", "gptq_v2"):
        raise refuse(model_dir, f"gptq bits={bits!r} checkpoint_format={fmt!r}")
    return Gptq(bits, int(d.get("group_size", -1)), 1 if fmt == "gptq" else 0)
