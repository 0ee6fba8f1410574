"""bitsandbytes, as transformers saves it. 8-bit (LLM.int8): int8 `weight` with a
per-row absmax `SCB`: weight = q * SCB / 127. 4-bit (nf4, fp4): `weight` is uint8
holding two codes a byte (the even element in the high nibble), `weight.absmax` one
scale per `blocksize` elements (itself 8-bit blockwise-quantized when nested:
nested_quant_map[code] * nested_absmax + nested_offset), `weight.quant_map` the 16
code values, and `weight.quant_state.bitsandbytes__<type>` the JSON of shape,
blocksize and nesting: weight = quant_map[code] * absmax[block]."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from worker_svc.model.quantization import QuantMethod, refuse


class Bnb8bit(QuantMethod):
    name = "bitsandbytes 8-bit"
    suffixes = frozenset({"SCB", "weight_format"})

    def dequantize(self, prefix: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        return t["weight"].float() * (t["SCB"].float().reshape(-1, 1) / 127.0)


class Bnb4bit(QuantMethod):
    name = "bitsandbytes 4-bit"
    suffixes = frozenset({"weight.absmax", "weight.quant_map", "weight.nested_absmax",
                          "weight.nested_quant_map", "weight.quant_state.bitsandbytes__nf4",
                          "weight.quant_state.bitsandbytes__fp4"})

    def shape(self, entries, read) -> tuple[int, int]:
        key = next(k for k in entries if k.startswith("weight.quant_state.bitsandbytes__"))
        return tuple(json.loads(bytes(read(key).to(torch.uint8).tolist()).decode())["shape"])

    def dequantize(self, prefix: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        key = next(k for k in t if k.startswith("weight.quant_state.bitsandbytes__"))
        state = json.loads(bytes(t[key].to(torch.uint8).tolist()).decode())
        shape = tuple(state["shape"])
        n = math.prod(shape)
        packed = t["weight"].reshape(-1).to(torch.int32)
        codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n]
        absmax = t["weight.absmax"]
        if "weight.nested_absmax" in t:
            nb = int(state["nested_blocksize"])
            idx = torch.arange(absmax.numel()) // nb
            absmax = (t["weight.nested_quant_map"].float()[absmax.long()]
                      * t["weight.nested_absmax"].float()[idx] + float(state["nested_offset"]))
        block = torch.arange(n) // int(state["blocksize"])
        values = t["weight.quant_map"].float()[codes.long()] * absmax.float()[block]
        return values.reshape(shape)


def from_config(model_dir: Path, d: dict) -> QuantMethod:
    if d.get("load_in_8bit"):
        return Bnb8bit()
    if d.get("load_in_4bit"):
        kind = d.get("bnb_4bit_quant_type", "fp4")
        if kind not in ("nf4", "fp4"):
            raise refuse(model_dir, f"bitsandbytes 4-bit bnb_4bit_quant_type={kind!r}")
        return Bnb4bit()
    raise refuse(model_dir, "bitsandbytes without load_in_8bit or load_in_4bit")
