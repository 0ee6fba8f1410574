"""Read safetensors files without mapping them: each tensor's bytes go straight into place.

A safetensors file is an 8-byte little-endian header length, a JSON header
({name: {dtype, shape, data_offsets: [begin, end]}}, offsets relative to the data
after the header) and the raw little-endian data. Reading with `readinto` instead of
mapping the file means the process never holds the file's pages and the weights
together: its peak resident set is the weights once.
"""

from __future__ import annotations

import json
import math
import mmap
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

# bytes per element of every safetensors dtype we can check the size of
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
             "F64": 8}
_TORCH = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
          "I32": torch.int32, "I64": torch.int64, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn}
_MAX_HEADER = 100 << 20  # safetensors' own limit: a larger length means a corrupt file
_POPULATE_MIN = 1 << 20  # below this, torch.empty's page faults cost nothing worth saving


class CheckpointError(ValueError):
    """A safetensors file is corrupt, truncated, or not what the model needs."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    path: Path
    name: str
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute position of the first byte in the file
    nbytes: int
    # a GGUF tensor (worker_svc/model/loading/gguf_tensors.py): its ggml type, dequantized to
    # float32 on read; the rows per head whose RoPE pairs llama.cpp interleaved; the
    # constant its converter added to norm weights (undone)
    ggml_type: int | None = None
    rope_head_dim: int = 0
    norm_offset: float = 0.0

    def torch_dtype(self) -> torch.dtype:
        if self.ggml_type is not None:
            return torch.float32
        if self.dtype not in _TORCH:
            raise CheckpointError(f"{self.path}: tensor {self.name} has dtype {self.dtype}, "
                                  "which the worker cannot load")
        return _TORCH[self.dtype]


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of one file, checked against the file's real size."""
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header "
                                  "(truncated file?)")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit in the file's "
                                  f"{size} bytes (truncated or corrupt file?)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, meta, data_start, data_len)
    return entries


def _entry(path: Path, name: str, meta, data_start: int, data_len: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
        ok = (isinstance(dtype, str) and all(type(d) is int and d >= 0 for d in shape)
              and type(begin) is int and type(end) is int)
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: tensor {name} has a malformed header entry {meta!r}")
    if not 0 <= begin <= end <= data_len:
        raise CheckpointError(f"{path}: tensor {name} has data_offsets [{begin}, {end}] "
                              f"outside the file's {data_len} data bytes "
                              "(truncated or corrupt file?)")
    if dtype in _ITEMSIZE and end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
        raise CheckpointError(f"{path}: tensor {name} has {end - begin} bytes but shape "
                              f"{shape} of {dtype} needs "
                              f"{math.prod(shape) * _ITEMSIZE[dtype]}")
    return TensorEntry(path, name, dtype, tuple(shape), data_start + begin, end - begin)


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """An uninitialized tensor to read weights into. Large CPU ones get their own
    anonymous mapping, faulted in by the kernel in one call (MAP_POPULATE): on this
    VM that loads the default model ~0.1 s faster than faulting page by page."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    flags = getattr(mmap, "MAP_POPULATE", 0)
    if torch.device(device).type != "cpu" or nbytes < _POPULATE_MIN or not flags:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps buf alive


class TensorReader:
    """Copies tensors from open files into destination tensors, each byte read once."""

    def __init__(self) -> None:
        if sys.byteorder != "little":  # safetensors data is little-endian
            raise CheckpointError("reading safetensors needs a little-endian host")
        self._files: dict[Path, object] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def read_into(self, entry: TensorEntry, dest: torch.Tensor) -> None:
        """Fill `dest` (contiguous, same number of elements) with the tensor's values."""
        if dest.numel() != math.prod(entry.shape) or not dest.is_contiguous():
            raise CheckpointError(f"{entry.path}: tensor {entry.name} of shape "
                                  f"{list(entry.shape)} does not fit its destination "
                                  f"{list(dest.shape)}")
        if entry.ggml_type is not None:  # GGUF: raw blocks in, float32 values out
            self._read_gguf(entry, dest)
            return
        src_dtype = entry.torch_dtype()
        if dest.device.type == "cpu" and dest.dtype == src_dtype:
            self._read_bytes(entry, dest)
            return
        # another dtype or device: through one temporary the size of this tensor
        tmp = torch.empty(entry.shape, dtype=src_dtype)
        self._read_bytes(entry, tmp)
        dest.copy_(tmp.view(dest.shape))

    def _read_gguf(self, entry: TensorEntry, dest: torch.Tensor) -> None:
        from worker_svc.model.loading.gguf_tensors import dequantized

        raw = torch.empty(entry.nbytes, dtype=torch.uint8)
        self._read_bytes(entry, raw)
        values = torch.from_numpy(dequantized(entry, raw.numpy()))
        dest.copy_(values.view(dest.shape))

    def _read_bytes(self, entry: TensorEntry, dest: torch.Tensor) -> None:
        if entry.nbytes == 0:
            return
        view = memoryview(dest.reshape(-1).view(torch.uint8).numpy()).cast("B")
        f = self._file(entry.path)
        f.seek(entry.offset)
        done = 0
        while done < entry.nbytes:  # a raw read may return fewer bytes than asked
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{entry.path}: file ends inside tensor {entry.name} "
                                      f"(read {done} of {entry.nbytes} bytes; truncated?)")
            done += got

    def _file(self, path: Path):
        if path not in self._files:
            self._files[path] = open(path, "rb", buffering=0)
        return self._files[path]
