"""GGUF's quantized weights held as their blocks, dequantized inside the matmul
(csrc/quant_linear.c): the quantized path of a GGUF file (docs/formats.md).

A QuantWeight is a matmul weight [out, in] kept as the file's bytes: one segment per
part of a fused projection ([q; k; v], [gate; up]), each its own ggml type (a Q4_K_M
file mixes Q4_K, Q5_0, Q6_K and Q8_0), rows in order. The kernel widens each weight
row once a call into fp32 in L1, exactly as gguf.quants.dequantize does, and dots it
with every row of x in fp32: only the order of the sums differs from dequantize-then-
matmul, for any number of rows. `gather` widens rows by index (the embedding lookup
of a quantized token_embd).

`pack` (--quant-activations int8) replaces each segment's blocks with a repacked copy
for the int8-activation path (csrc/quant_packed.h): x rounded to int8 per 32 values,
block sums in integers, not exact; the copy rides in the descriptor after the
segments (PACKED_FLAG), so every caller, the C layer loops included, takes it.

QuantLinear is called where the small-batch kernel is (small_linear.SmallLinear hands
a QuantWeight here), where the torch-layer families' layers.linear meets one (and
layers.vocab_parallel_embed calls `gather`), and the C layer loop calls `quant_linear`
in small_linear_q8's place (decode_layers.py): same signature, the descriptor where
the int8 rows would be.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch

from worker_svc import native

# -ffp-contract=off: the widened values are gguf.quants.dequantize's bit for bit (no
# multiply-add fused where numpy rounds twice)
FLAGS = ("-fopenmp", "-ffp-contract=off")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# ggml types the kernel reads (ggml.h values), by GGUF name
TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
         "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
NAMES = {v: k for k, v in TYPES.items()}
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
# (values, bytes) of a block of each type
BLOCK = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20),
         "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q4_K": (256, 144),
         "Q5_K": (256, 176), "Q6_K": (256, 210)}
MAX_SEGMENTS = 8  # quant_linear.c's
_PACKED_FLAG = 1 << 16  # quant_linear.c's read_desc: repacked copies follow the segments
# the types quant_pack repacks for the int8-activation path (csrc/quant_packed.h)
PACKS = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"})
PACKED_LOOPS = ("portable", "avx2", "avx512_vnni")  # by quant_packed_loop()'s value


def row_bytes(kind: str, in_features: int) -> int:
    values, size = BLOCK[kind]
    if in_features % values:
        raise ValueError(f"a {kind} row holds whole blocks of {values} values; "
                         f"{in_features} is not a multiple")
    return in_features // values * size


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A weight [out, in] as segments of block rows: (GGUF type name, uint8 tensor
    [rows, row bytes]), their rows stacked in order."""
    segments: tuple[tuple[str, torch.Tensor], ...]
    in_features: int
    # per segment: its repacked copy (`pack`: the int8-activation path) or None
    packed: tuple[torch.Tensor | None, ...] = ()
    desc: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= len(self.segments) <= MAX_SEGMENTS:
            raise ValueError(f"a quantized weight has 1 to {MAX_SEGMENTS} segments")
        flat = [len(self.segments)]
        for kind, data in self.segments:
            if kind not in TYPES:
                raise ValueError(f"GGUF type {kind} has no quantized kernel")
            if data.dtype != torch.uint8 or data.dim() != 2 or not data.is_contiguous() \
                    or data.shape[1] != row_bytes(kind, self.in_features):
                raise ValueError(f"a {kind} segment must be contiguous uint8 [rows, "
                                 f"{row_bytes(kind, self.in_features)}]")
            flat += [TYPES[kind], data.shape[0], data.data_ptr(), data.shape[1]]
        if self.packed:
            if len(self.packed) != len(self.segments):
                raise ValueError("one repacked copy (or None) per segment")
            if any(d.is_meta and p is None for (_, d), p in zip(self.segments, self.packed)):
                raise ValueError("a segment without blocks needs its repacked copy")
            flat[0] |= _PACKED_FLAG
            flat += [0 if p is None else p.data_ptr() for p in self.packed]
        object.__setattr__(self, "desc", torch.tensor(flat, dtype=torch.int64))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(d.shape[0] for _, d in self.segments), self.in_features))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(kind for kind, _ in self.segments)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor it holds: the blocks (not a repacked segment's shape-only
        stand-in) and the repacked copies."""
        return tuple(d for _, d in self.segments if not d.is_meta) + tuple(
            p for p in self.packed if p is not None)

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in] (the kernel's widening, every row)."""
        lib = load()
        if lib is None:
            raise RuntimeError("the quantized-weight kernel is not built (no C compiler)")
        return lib.gather(self, torch.arange(self.shape[0]))


def pack(weight: QuantWeight) -> QuantWeight:
    """The weight with each segment of a type in PACKS repacked (the int8-activation
    path, csrc/quant_packed.h) in place of its blocks: a shape-only ("meta") tensor
    stands for them, as the repacked copy widens to the same values (`gather`,
    `dequantize`: quant_packed.h's pk_gather_row). Other segments keep their blocks
    and the exact path."""
    lib = load()
    if lib is None:
        raise RuntimeError("the quantized-weight kernel is not built (no C compiler)")
    packed: list[torch.Tensor | None] = []
    for kind, data in weight.segments:
        if kind not in PACKS or weight.in_features % BLOCK[kind][0]:
            packed.append(None)
            continue
        rows = data.shape[0]
        dst = torch.empty(lib.pack_bytes(TYPES[kind], rows, weight.in_features),
                          dtype=torch.uint8)
        if lib.pack(TYPES[kind], data.data_ptr(), rows, data.shape[1], weight.in_features,
                    dst.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"quant_pack: could not repack a {kind} [{rows}, "
                              f"{weight.in_features}] weight")
        packed.append(dst)
    segments = tuple((kind, data if p is None else torch.empty(data.shape, dtype=torch.uint8,
                                                              device="meta"))
                     for (kind, data), p in zip(weight.segments, packed))
    return QuantWeight(segments, weight.in_features, tuple(packed))


def concat(parts: list[QuantWeight]) -> QuantWeight:
    """The parts' rows stacked (a fused projection); adjacent segments of one type are
    joined into one."""
    segments: list[tuple[str, torch.Tensor]] = []
    for p in parts:
        if p.in_features != parts[0].in_features:
            raise ValueError("fused parts differ in input features")
        for kind, data in p.segments:
            if segments and segments[-1][0] == kind:
                segments[-1] = (kind, torch.cat([segments[-1][1], data]))
            else:
                segments.append((kind, data))
    return QuantWeight(tuple(segments), parts[0].in_features)


class QuantLinear:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.quant_linear
        self.fn.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, ctypes.c_int]
        self.fn.restype = ctypes.c_int
        self._gather = lib.quant_gather_rows
        self._gather.argtypes = [_P, _I64, _I64, _P, _I64, _P, ctypes.c_int]
        self._gather.restype = ctypes.c_int
        self._portable = lib.quant_linear_portable
        self._portable.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, ctypes.c_int]
        self._portable.restype = ctypes.c_int
        self.pack = lib.quant_pack
        self.pack.argtypes = [ctypes.c_int, _P, _I64, _I64, _I64, _P, ctypes.c_int]
        self.pack.restype = ctypes.c_int
        self.pack_bytes = lib.quant_pack_bytes
        self.pack_bytes.argtypes = [ctypes.c_int, _I64, _I64]
        self.pack_bytes.restype = _I64
        # the loop the int8-activation path runs here (quant_packed.h's pk_loop)
        self.packed_loop = PACKED_LOOPS[lib.quant_packed_loop()]

    def __call__(self, x: torch.Tensor, weight: QuantWeight,
                 bias: torch.Tensor | None = None, portable: bool = False) -> torch.Tensor:
        """x [rows, in] fp32 @ weight.T + bias, fp32 [rows, out]. `portable`: the
        repacked segments on the portable loop, the reference of the SIMD one (tests)."""
        if x.dtype != torch.float32:
            raise TypeError(f"the quantized kernel takes fp32 activations, not {x.dtype}")
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, (out, inp) = x.shape[0], weight.shape
        y = torch.empty(rows, out, dtype=torch.float32)
        if rows:
            args = (x.data_ptr(), x.stride(0), rows, weight.desc.data_ptr())
            rest = (out, inp, y.data_ptr(), torch.get_num_threads())
            rc = self._portable(*args, *rest) if portable else self.fn(*args, None, *rest)
            if rc == -2:
                raise MemoryError(f"quant_linear: no memory for a row of {inp} floats")
            if rc:
                raise ValueError(f"quant_linear: malformed weight {weight.types} {out}x{inp}")
        if bias is not None:
            y += bias
        return y

    def gather(self, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as fp32 [len(ids), in]."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out, inp = weight.shape
        dst = torch.empty(ids.shape[0], inp, dtype=torch.float32)
        if self._gather(weight.desc.data_ptr(), out, inp, ids.data_ptr(), ids.shape[0],
                        dst.data_ptr(), torch.get_num_threads()):
            raise IndexError(f"a token id outside 0..{out - 1} (or a malformed weight)")
        return dst


@functools.cache
def load() -> QuantLinear | None:
    lib = native.open_library("quant_linear", FLAGS)
    return None if lib is None else QuantLinear(lib)


def address() -> int:
    """quant_linear's address, for the C layer loop's function table."""
    return ctypes.cast(load().fn, ctypes.c_void_p).value
