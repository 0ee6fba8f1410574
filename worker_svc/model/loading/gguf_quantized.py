"""A GGUF's weights on the quantized path: every matmul weight and the embedding kept
as the file's blocks (model/cpu/quant_weights.QuantWeight), norms and the MoE router
as the exact path's float32. No matmul value is widened at load: a load is a read of
the file's bytes, not a dequantization.

There is no second loader: each family's own `load_weights` reads the file through
QuantizedSlices, the exact path's CheckpointSlices (same names, q/k row order, checks,
Gemma's 1 + w norm fix-up) whose matmul reads (`fused`, `columns`, `embed_and_head`)
return QuantWeights. A tensor of a type the kernel does not read (Q2_K, Q3_K) is
widened to an F32 segment here, through the exact path's dequantization: served
right, at fp32's size (the start log counts it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from shared.telemetry import get_logger
from worker_svc.model.config import ModelConfig
from worker_svc.model.cpu.quant_weights import TYPES, QuantWeight, concat, load, pack
from worker_svc.model.loading.gguf_tensors import dequantized, quantized_rows
from worker_svc.model.loading.safetensors_io import TensorEntry
from worker_svc.model.loading.weights import CheckpointSlices

log = get_logger(service="worker")


def _quant(e: TensorEntry) -> QuantWeight:
    kind = e.dtype.removeprefix("GGUF_")
    raw = np.fromfile(e.path, dtype=np.uint8, count=e.nbytes, offset=e.offset)
    if len(raw) != e.nbytes:
        raise ValueError(f"{e.path}: file ends inside tensor {e.name}")
    if kind in TYPES:
        rows = quantized_rows(e, raw)
    else:  # no kernel for it: the exact path's float32 values, as an F32 segment
        kind, rows = "F32", dequantized(e, raw).reshape(e.shape[0], -1).view(np.uint8)
    return QuantWeight(((kind, torch.from_numpy(rows)),), int(e.shape[1]))


class QuantizedSlices(CheckpointSlices):
    """CheckpointSlices of one whole rank whose matmul weights are QuantWeights: a 2-D
    tensor read by `fused`, `columns` or `embed_and_head` stays the file's blocks;
    everything `take` reads (norms, q/k norms, the router) and biases stay float."""
    holds_blocks = True

    def __init__(self, model_dir, cfg, plan, reader, dtype, device) -> None:
        if not plan.whole or device.type != "cpu":  # the compute plan never asks this
            raise ValueError("a GGUF's blocks are held on one CPU rank only")
        super().__init__(model_dir, cfg, plan, reader, torch.float32, device)

    def fused(self, names, dtype=None, whole=False, out=None):
        parts = [self.entry(n, whole) for n in names]
        if out is not None or len(parts[0].shape) != 2:  # a bias, or a float target
            return super().fused(names, dtype, whole, out)
        return concat([_quant(p) for p in parts])

    def columns(self, name, start, stop, dtype=None):
        return _quant(self.entry(name))  # one rank: every column

    def embed_and_head(self, tie, dtype=None):
        embed = _quant(self.entry("model.embed_tokens.weight"))
        if tie or "lm_head.weight" not in self.entries:
            if not tie:
                raise KeyError(f"checkpoint in {self.model_dir} lacks lm_head.weight (untied)")
            return embed, embed
        return embed, _quant(self.entry("lm_head.weight"))


def load_quantized_weights(model_dir: Path, cfg: ModelConfig, module,
                           activations: str = "float32"):
    """The whole model (one rank) as the family `module` holds it, with QuantWeights
    where its exact path has float matmul weights; repacked for the int8-activation
    path when `activations` is "int8" (--quant-activations)."""
    weights = module.load_weights(model_dir, cfg, torch.float32, torch.device("cpu"),
                                  slices=QuantizedSlices)
    if activations != "int8":
        return weights
    weights = pack_weights(weights)  # the blocks it replaced are unreferenced now:
    return_freed_memory()            # their pages go back
    if load().packed_loop == "portable":
        log.warning("quant_activations_portable_loop",
                    reason="this build has no AVX2 loop for the int8 path: its portable "
                    "loop is slower than the float32 path's; --quant-activations float32 "
                    "is faster here")
    return weights


def pack_weights(weights):
    """The weights with every matmul QuantWeight repacked for the int8-activation path
    (--quant-activations int8; quant_weights.pack), each once however often it is
    referenced (a tied head is the embedding), through dataclass fields and lists. An
    untied embedding is only looked up (its blocks widened by row): not repacked."""
    done: dict[int, QuantWeight] = {}
    lookup_only = {id(getattr(weights, "embed", None))} - {id(getattr(weights, "lm_head", None))}

    def visit(obj):
        if isinstance(obj, QuantWeight):
            if id(obj) in lookup_only:
                return obj
            if id(obj) not in done:
                done[id(obj)] = pack(obj)
            return done[id(obj)]
        if isinstance(obj, list):
            return [visit(item) for item in obj]
        if isinstance(obj, tuple):
            return tuple(visit(item) for item in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {}
            for f in dataclasses.fields(obj):
                if not f.init:
                    continue
                old = getattr(obj, f.name)
                new = visit(old)
                if new is not old:
                    changes[f.name] = new
            return dataclasses.replace(obj, **changes) if changes else obj
        return obj
    return visit(weights)


def return_freed_memory() -> None:
    """Freed heap pages back to the OS: glibc keeps them in its arenas until
    malloc_trim (after repacking, the file's blocks: 104 MiB of RSS on the default
    model's Q8_0 file). Call it once the blocks are unreferenced. A no-op off glibc."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def held_types(weights) -> dict[str, int]:
    """GGUF type -> bytes held in it, over every quantized weight (the start log's),
    of any family's weights: QuantWeights found through dataclass fields and lists."""
    seen: dict[int, tuple[str, int]] = {}

    def visit(obj) -> None:
        if isinstance(obj, QuantWeight):
            for kind, data in obj.segments:
                seen[id(data)] = (kind, data.numel())
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name))
    visit(weights)
    out: dict[str, int] = {}
    for kind, n in seen.values():
        out[kind] = out.get(kind, 0) + n
    return out

