"""A GGUF file's header read without its metadata arrays: the scalar and string
fields, and each tensor's name, shape, type and place in the file.

gguf.GGUFReader parses every metadata value into numpy objects, the tokenizer's too:
a 262k-entry vocabulary (Gemma 3) took ~30 s of a worker's start on a 2-core VM, and
the worker needs none of it. This reader walks the same bytes (the format of
llama.cpp's docs/gguf.md, version 2 and 3, little-endian) and steps over arrays
without building them; tests/gguf_input/test_gguf_header.py holds it to GGUFReader on
every file the tests write and on the shipped models. A file it cannot read (a
big-endian GGUF, a version it does not know) raises HeaderError, and callers fall
back to GGUFReader.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# metadata value types (gguf.GGUFValueType) -> struct format of a scalar
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class HeaderError(ValueError):
    """The file is not a GGUF this reader reads."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as the file lists them: innermost first
    ggml_type: int
    data_offset: int  # from the file's start
    n_bytes: int


@dataclass(frozen=True, slots=True)
class Header:
    fields: dict[str, object]  # scalars and strings; an array is (element type, count)
    tensors: tuple[TensorInfo, ...]


def read_header(path: str | Path) -> Header:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = 0

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize(fmt)
            if pos + size > len(m):
                raise HeaderError(f"{path}: the header ends early")
            (value,) = struct.unpack_from(fmt, m, pos)
            pos += size
            return value

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            if pos + n > len(m):
                raise HeaderError(f"{path}: a string runs past the file's end")
            value = bytes(m[pos:pos + n]).decode("utf-8", errors="replace")
            pos += n
            return value

        def skip_array(kind: int, count: int) -> None:
            nonlocal pos
            if kind in _SCALAR:
                pos += struct.calcsize(_SCALAR[kind]) * count
            elif kind == _STRING:
                for _ in range(count):
                    pos += 8 + struct.unpack_from("<Q", m, pos)[0]
            elif kind == _ARRAY:
                for _ in range(count):
                    inner, n = take("<I"), take("<Q")
                    skip_array(inner, n)
            else:
                raise HeaderError(f"{path}: metadata value type {kind} is not GGUF's")

        if m[:4] != MAGIC:
            raise HeaderError(f"{path}: not a GGUF file")
        pos = 4
        version = take("<I")
        if version not in (2, 3):
            raise HeaderError(f"{path}: GGUF version {version} (a big-endian file?)")
        n_tensors, n_fields = take("<Q"), take("<Q")
        fields: dict[str, object] = {}
        for _ in range(n_fields):
            key, kind = string(), take("<I")
            if kind in _SCALAR:
                fields[key] = take(_SCALAR[kind])
            elif kind == _STRING:
                fields[key] = string()
            elif kind == _ARRAY:
                inner, count = take("<I"), take("<Q")
                skip_array(inner, count)
                fields[key] = (inner, count)
            else:
                raise HeaderError(f"{path}: metadata value type {kind} is not GGUF's")
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(take("<Q") for _ in range(take("<I")))
            infos.append((name, dims, take("<I"), take("<Q")))
        alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = (pos + alignment - 1) // alignment * alignment
        tensors = []
        for name, dims, kind, offset in infos:
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise HeaderError(f"{path}: tensor {name} has ggml type {kind}, "
                                  "unknown to the gguf package") from None
            count = 1
            for d in dims:
                count *= d
            tensors.append(TensorInfo(name, dims, kind, start + offset,
                                      count // block * size))
        return Header(fields, tuple(tensors))
