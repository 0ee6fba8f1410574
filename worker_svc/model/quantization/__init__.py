"""Quantized Hugging Face checkpoints, dequantized to float weights at load (the exact
path: float activations, token-equal to transformers on the dequantized float twin).

Laid out as vLLM's model_executor/layers/quantization/: one module per method, each
a QuantMethod parsed from config.json's `quantization_config` that turns one linear's
stored tensors (`qweight`, `weight_scale`, ...) into its float `weight` [out, in].
CheckpointSlices (worker_svc/model/loading/weights.py) applies it to every linear before a
family reads a tensor, so a model file never knows how its weights were stored.
A method or a variant not listed in METHODS is refused here, by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from worker_svc.model.loading.safetensors_io import CheckpointError


class QuantMethod:
    """One quantization method as a checkpoint's config states it."""

    name = "base"
    quant_method = ""  # the config's name for it, and the file that config is in:
    source = "config.json"  # both set by method_of
    # last parts of tensor names this method stores beside or instead of `weight`
    suffixes: frozenset[str] = frozenset()

    def dequantize(self, prefix: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 weight [out, in] of the linear `prefix` from its stored tensors
        (keyed by last name part: "weight", "weight_scale", "qweight", ...)."""
        raise NotImplementedError

    def shape(self, entries: dict, read) -> tuple[int, int]:
        """The float weight's [out, in] from the stored tensors' entries (keyed as in
        dequantize); `read(key)` gives a small tensor's values where the shape is in one."""
        return tuple(entries["weight"].shape)

    def skips(self, prefix: str) -> bool:
        """True for a linear the config leaves unquantized (compressed-tensors' ignore)."""
        return False


def refuse(model_dir: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint in {model_dir} is quantized ({what}), which is not "
                           "supported; use a float16/bfloat16/float32 checkpoint or a "
                           "supported method (docs/formats.md)")


def method_of(model_dir: Path, hf_config) -> QuantMethod | None:
    """The checkpoint's QuantMethod, None for a float checkpoint; refuses by name a
    method, or a variant of one, that is not loaded exactly."""
    from worker_svc.model.quantization import (awq, bitsandbytes, compressed_tensors, fp8,
                                               gptq)
    methods = {"compressed-tensors": compressed_tensors.from_config, "fp8": fp8.from_config,
               "gptq": gptq.from_config, "awq": awq.from_config,
               "bitsandbytes": bitsandbytes.from_config}
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        qc = getattr(hf_config, "compression_config", None)
    source = "config.json"
    for file, default in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        if not qc and (model_dir / file).is_file():  # AutoGPTQ/AutoAWQ's own file
            try:
                qc = {"quant_method": default, **json.loads((model_dir / file).read_text())}
            except (OSError, ValueError) as e:
                raise refuse(model_dir, f"{file} unreadable: {e}") from None
            source = file
    if not qc:
        return None
    d = qc if isinstance(qc, dict) else getattr(qc, "to_dict", lambda: vars(qc))()
    name = d.get("quant_method", "unknown")
    name = getattr(name, "value", name)  # transformers' QuantizationMethod enum
    if name not in methods:
        raise refuse(model_dir, f"quant_method={name!r} in {source}")
    method = methods[name](model_dir, d)
    method.quant_method, method.source = name, source
    return method


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-wide codes packed low bits first into int32 along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32).unsqueeze(-1) if dim in (-1, packed.dim() - 1) else None
    if p is not None:
        codes = (p >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    # along dim 0: [rows, cols] -> [rows * per, cols]
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0] * per, *packed.shape[1:])
