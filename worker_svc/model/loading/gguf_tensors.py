"""A GGUF file as a tensor source: each tensor under our (Hugging Face) name, with the
place of its bytes in the file and its GGML type, so the worker's CheckpointSlices
reads it like a safetensors tensor (row slices for tensor parallelism included: a
quantized row is whole blocks) and TensorReader dequantizes it on the way in.

Two paths read it: the exact one (`dequantized(entry)`: float32 values, through
TensorReader) and the quantized one (`quantized_rows(entry)`: the tensor's blocks as
they are in the file, rows permuted as the exact path permutes its values, for
model/cpu/quant_weights.py; loading/gguf_quantized.py assembles the model).

Per architecture, one table maps GGUF names to ours and names the fix-up llama.cpp's
converter needs undone: llama's q/k row permutation (interleaved RoPE pairs), Gemma's
norm weights stored as 1 + w. transformers' GGUF loader undoes the same, in the same
order (dequantize to float32, then fix up), so the values are bit-equal to its load.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.model_files.gguf_model import (SUPPORTED_TYPES, GGUFError, check_gguf,
                                           gguf_header, type_name)
from shared.telemetry import get_logger
from worker_svc.model.loading.safetensors_io import TensorEntry

log = get_logger(service="worker")

_COMMON_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GEMMA_BLOCK = {**_COMMON_BLOCK, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_PHI3_BLOCK = {**_COMMON_BLOCK, "attn_qkv": "self_attn.qkv_proj",
               "ffn_up": "mlp.gate_up_proj"}  # phi3's GGUF keeps HF's fused layout
_MOE_BLOCK = {**_COMMON_BLOCK, "ffn_gate_inp": "mlp.gate"}
# stacked experts [n_expert, rows, cols] -> one entry per expert under these names
_EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj",
            "ffn_up_exps": "mlp.experts.{e}.up_proj",
            "ffn_down_exps": "mlp.experts.{e}.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
        "output": "lm_head"}

# general.architecture -> (block table, undo llama's q/k permutation, norm offset);
# shared/gguf_model.ARCHITECTURES decides which are served
TABLES = {
    "llama": (_COMMON_BLOCK, True, 0.0),
    "qwen2": (_COMMON_BLOCK, False, 0.0),
    "qwen3": (_COMMON_BLOCK, False, 0.0),
    "qwen3moe": (_MOE_BLOCK, False, 0.0),
    "gemma2": (_GEMMA_BLOCK, False, -1.0),
    "gemma3": (_GEMMA_BLOCK, False, -1.0),
    "phi3": (_PHI3_BLOCK, False, 0.0),
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_entries(path: Path, head_dim: int) -> dict[str, TensorEntry]:
    """Every tensor of the GGUF under our names (checked: architecture and types)."""
    arch, tensors = _listing(path)
    block, permute, norm_offset = TABLES[arch]
    entries: dict[str, TensorEntry] = {}
    for t in tensors:
        shape, kind = t.shape, t.kind
        if kind not in SUPPORTED_TYPES:  # check_gguf refused it already; belt and braces
            raise GGUFError(f"{path}: tensor {t.name} has GGUF type {kind}")
        base = dict(path=path, dtype=f"GGUF_{kind}", ggml_type=t.ggml_type)
        m = _BLOCK_NAME.match(t.name)
        if m and m.group(2) in _EXPERTS and arch == "qwen3moe":
            per = t.n_bytes // shape[0]  # each expert's rows are contiguous bytes
            for e in range(shape[0]):
                name = f"model.layers.{m.group(1)}." + _EXPERTS[m.group(2)].format(e=e) \
                    + "." + m.group(3)
                entries[name] = TensorEntry(name=name, shape=shape[1:],
                                            offset=t.data_offset + e * per,
                                            nbytes=per, **base)
            continue
        if m:
            part = block.get(m.group(2))
            if part is None:
                raise GGUFError(f"{path}: tensor {t.name} has no counterpart in the "
                                f"{arch} family (not served)")
            name = f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
        else:
            top, _, suffix = t.name.rpartition(".")
            if top not in _TOP:
                raise GGUFError(f"{path}: tensor {t.name} has no counterpart in the "
                                f"{arch} family (not served)")
            name = f"{_TOP[top]}.{suffix}"
        rope = head_dim if permute and name.endswith(("q_proj.weight", "k_proj.weight")) \
            else 0
        offset = norm_offset if name.endswith("norm.weight") else 0.0
        entries[name] = TensorEntry(name=name, shape=shape, offset=t.data_offset,
                                    nbytes=t.n_bytes, rope_head_dim=rope,
                                    norm_offset=offset, **base)
    log.info("gguf_tensors_listed", gguf=str(path), architecture=arch,
             tensors=len(entries), types=sorted({e.dtype for e in entries.values()}))
    return entries


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # ours: outer dimension first
    kind: str  # GGUF type name
    ggml_type: int
    data_offset: int
    n_bytes: int


def _listing(path: Path) -> tuple[str, tuple[_Tensor, ...]]:
    """(architecture, tensors) of the file, checked (check_gguf): parsed once per
    process and file version, as the compute plan, the loader and a family's second
    read (Gemma's feed-forward norms) all list it."""
    st = Path(path).stat()
    return _parsed(Path(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed(path: Path, size: int, mtime_ns: int) -> tuple[str, tuple[_Tensor, ...]]:
    header = gguf_header(path)  # its metadata arrays (the vocabulary) stepped over
    arch = check_gguf(path, header)
    return arch, tuple(
        _Tensor(name=t.name, shape=tuple(reversed(t.dims)),  # the file lists inner-first
                kind=type_name(t.ggml_type), ggml_type=t.ggml_type,
                data_offset=t.data_offset, n_bytes=t.n_bytes)
        for t in header.tensors)


def raw_blocks(entry: TensorEntry, raw: np.ndarray) -> tuple[np.ndarray, int]:
    """The seam for a quantized path: the entry's bytes as [rows, row bytes] uint8
    blocks and the ggml type that decodes them."""
    rows = entry.shape[0] if len(entry.shape) > 1 else 1
    return raw.reshape(rows, -1), int(entry.ggml_type)


def matmul_types(path: Path) -> dict[str, int]:
    """GGUF type name -> bytes of the file's 2-D tensors (matmul weights and the
    embedding) of that type: what the compute plan reads to choose the path."""
    out: dict[str, int] = {}
    for t in _listing(path)[1]:
        if len(t.shape) >= 2:
            out[t.kind] = out.get(t.kind, 0) + t.n_bytes
    return out


def quantized_rows(entry: TensorEntry, raw: np.ndarray) -> np.ndarray:
    """The entry's blocks as [rows, row bytes] uint8, rows in our layout: llama's q/k
    rows un-interleaved exactly as `dequantized` moves its values (a row is whole
    blocks, so moving rows of blocks moves rows of values). Norm offsets apply to
    norms only, which are never held quantized."""
    if entry.norm_offset:
        raise ValueError(f"{entry.name}: a norm weight is not held quantized")
    blocks, _ = raw_blocks(entry, raw)
    if entry.rope_head_dim:
        rows, width = blocks.shape
        n_head, half = rows // entry.rope_head_dim, entry.rope_head_dim // 2
        blocks = blocks.reshape(n_head, half, 2, width).swapaxes(2, 1).reshape(rows, width)
    return np.ascontiguousarray(blocks)


def dequantized(entry: TensorEntry, raw: np.ndarray) -> np.ndarray:
    """The entry's float32 values in our layout, from its raw bytes: gguf.quants.
    dequantize, then llama.cpp's converter's fix-ups undone (as transformers does)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks, kind = raw_blocks(entry, raw)
    w = _widened_in_c(entry, blocks, GGMLQuantizationType(kind).name)
    if w is None:
        w = np.asarray(dequantize(blocks, GGMLQuantizationType(kind)), dtype=np.float32)
    w = w.reshape(entry.shape)
    if entry.rope_head_dim:  # rows of whole heads: undo the per-head pair interleave
        n_head = w.shape[0] // entry.rope_head_dim
        half = entry.rope_head_dim // 2
        w = w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
    if entry.norm_offset:
        w = w + np.float32(entry.norm_offset)
    return np.ascontiguousarray(w)


def _widened_in_c(entry: TensorEntry, blocks: np.ndarray, kind: str) -> np.ndarray | None:
    """A 2-D block tensor's float32 values through the quantized kernel's widening
    (csrc/quant_linear.c, built -ffp-contract=off: gguf.quants.dequantize's values bit
    for bit, tests/worker/test_quant_linear.py) on every core: numpy's dequantize took
    ~20 s of the default model's load and most of Gemma 3 270M's. None where the
    kernel is not built or does not read the type: numpy then."""
    from worker_svc.model.cpu import quant_weights

    if len(entry.shape) != 2 or kind in quant_weights.FLOAT_TYPES \
            or kind not in quant_weights.TYPES or quant_weights.load() is None:
        return None
    rows = torch.from_numpy(np.array(blocks, dtype=np.uint8, order="C"))  # a writable copy
    weight = quant_weights.QuantWeight(((kind, rows),), entry.shape[1])
    return weight.dequantize().numpy()
