"""quant_method "fp8": FP8 E4M3 codes in `weight` with block scales in
`weight_scale_inv` (DeepSeek-V3, Qwen3-FP8: one scale per weight_block_size block,
multiplied in despite its name, as transformers' FineGrainedFP8 and vLLM do) or one
per-tensor/per-row `weight_scale` (vLLM's serialized fp8). Activation scales are
the fast path's; the exact path multiplies floats."""

from __future__ import annotations

from pathlib import Path

import torch

from worker_svc.model.quantization import QuantMethod, refuse


class Fp8(QuantMethod):
    name = "fp8"
    suffixes = frozenset({"weight_scale_inv", "weight_scale", "input_scale"})

    def __init__(self, block: tuple[int, int] | None) -> None:
        self.block = block

    def dequantize(self, prefix: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        w = t["weight"].float()
        if "weight_scale_inv" in t:
            if self.block is None:
                raise ValueError(f"{prefix}.weight_scale_inv without weight_block_size")
            s = t["weight_scale_inv"].float()
            b0, b1 = self.block
            s = s.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
            return w * s[:w.shape[0], :w.shape[1]]
        s = t["weight_scale"].float()
        return w * (s.reshape(1, 1) if s.numel() == 1 else s.reshape(-1, 1))


def from_config(model_dir: Path, d: dict) -> Fp8:
    fmt = d.get("fmt", "e4m3")
    block = d.get("weight_block_size")
    if fmt != "e4m3" or (block is not None and len(block) != 2):
        raise refuse(model_dir, f"fp8 fmt={fmt!r} weight_block_size={block!r}")
    return Fp8(tuple(block) if block else None)
