"""Apply a QuantMethod to a checkpoint's entries: every linear stored quantized becomes
one float32 `<linear>.weight` entry that a DequantizingReader fills on read, one
linear at a time (the last one kept for its other row slices), so a load holds the
model's float weights plus a single dequantized linear, never a float copy of all."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from shared.telemetry import get_logger
from worker_svc.model.quantization import QuantMethod
from worker_svc.model.loading.safetensors_io import TensorEntry, TensorReader

log = get_logger(service="worker")
# the path of an entry a DequantizingReader computes instead of reading
DEQUANTIZED = Path("<dequantized>")


def split_name(name: str) -> tuple[str, str]:
    """'a.q_proj.weight_scale' -> ('a.q_proj', 'weight_scale'); bitsandbytes 4-bit's
    'a.q_proj.weight.absmax' -> ('a.q_proj', 'weight.absmax')."""
    if ".weight." in name:
        prefix, rest = name.split(".weight.", 1)
        return prefix, "weight." + rest
    prefix, _, last = name.rpartition(".")
    return prefix, last


class DequantizingReader:
    """A TensorReader that computes DEQUANTIZED entries from their stored tensors."""

    def __init__(self, reader: TensorReader, method: QuantMethod,
                 stored: dict[str, dict[str, TensorEntry]]) -> None:
        self.reader, self.method, self.stored = reader, method, stored
        self._last: tuple[str, torch.Tensor] | None = None

    def read_stored(self, e: TensorEntry) -> torch.Tensor:
        out = torch.empty(e.shape, dtype=e.torch_dtype())
        self.reader.read_into(e, out)
        return out

    def read_into(self, entry: TensorEntry, dest: torch.Tensor) -> None:
        if entry.path != DEQUANTIZED:
            self.reader.read_into(entry, dest)
            return
        prefix = entry.name.removesuffix(".weight")
        if self._last is None or self._last[0] != prefix:
            tensors = {k: self.read_stored(e) for k, e in self.stored[prefix].items()}
            w = self.method.dequantize(prefix, tensors).to(torch.float32).contiguous()
            self._last = (prefix, w.reshape(-1).view(torch.uint8))
        raw = self._last[1][entry.offset:entry.offset + entry.nbytes]
        dest.copy_(raw.view(torch.float32).view(dest.shape))


def dequantized_entries(model_dir: Path, entries: dict[str, TensorEntry],
                        method: QuantMethod, reader: TensorReader
                        ) -> tuple[dict[str, TensorEntry], DequantizingReader, int]:
    """`entries` with each quantized linear's stored tensors replaced by its float
    weight, the reader that computes those weights, and how many linears it took."""
    keys = method.suffixes | {"weight"}
    by_linear: dict[str, dict[str, TensorEntry]] = {}
    for name, e in entries.items():
        prefix, key = split_name(name)
        if key in keys:
            by_linear.setdefault(prefix, {})[key] = e
    stored = {p: t for p, t in by_linear.items() if set(t) & method.suffixes}
    deq = DequantizingReader(reader, method, stored)
    out = dict(entries)
    start = time.perf_counter()
    for prefix, tensors in stored.items():
        for key, e in tensors.items():
            del out[e.name]
        shape = tuple(method.shape(tensors, lambda k: deq.read_stored(tensors[k])))
        name = f"{prefix}.weight"
        out[name] = TensorEntry(DEQUANTIZED, name, "F32", shape, 0, math.prod(shape) * 4)
    log.info("checkpoint_dequantized", model_dir=str(model_dir), method=method.name,
             linears=len(stored), seconds=round(time.perf_counter() - start, 3))
    return out, deq, len(stored)
