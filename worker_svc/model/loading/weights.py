"""Read a checkpoint's safetensors (one file or sharded) into fused per-layer weights,
each weight allocated once and read straight into place (no mmap, no copies)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model_files.gguf_model import gguf_source
from worker_svc.model import quantization
from worker_svc.model.loading.checkpoint_checks import (check_checkpoint, refuse_non_float,
                                                refuse_unread_quantized)
from worker_svc.model.config import ModelConfig
from worker_svc.model.quantization.linears import dequantized_entries
from worker_svc.model.loading.safetensors_io import (CheckpointError, TensorEntry, TensorReader,
                                             new_tensor, read_header)
from worker_svc.parallel.shard import ShardPlan, whole_plan


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q; k; v] rows fused: one matmul instead of three
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [gate; up] rows fused
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding itself when tied
    # the small-batch kernel's copies of the matmul weights (worker_svc/model/
    # small_linear.py): plain row-major ones of prepacked weights, or Int8Weights under
    # --quantization int8; None when the layers themselves serve it
    plain_layers: list[LayerWeights] | None = None
    plain_lm_head: torch.Tensor | None = None
    # an int8 copy of the vocabulary projection that screens greedy rows (small_linear.
    # screened_argmax_logits); None when the small-batch kernel projects exactly in int8
    argmax_screen: object | None = None


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def checkpoint_entries(model_dir: Path) -> dict[str, TensorEntry]:
    """Where every tensor of the checkpoint lies, from the headers of all its files
    (a GGUF view directory's: from the GGUF file it names, shared/model_files/gguf_model.py)."""
    source = gguf_source(model_dir)
    if source is not None:
        from worker_svc.model.config import load_model_config
        from worker_svc.model.loading.gguf_tensors import gguf_entries
        return gguf_entries(source, load_model_config(model_dir).head_dim)
    entries: dict[str, TensorEntry] = {}
    for path in checkpoint_files(model_dir):
        for name, entry in read_header(path).items():
            if name in entries:
                raise CheckpointError(f"tensor {name} is in both {entries[name].path} "
                                      f"and {path}")
            entries[name] = entry
    return entries


def row_slice(e: TensorEntry, start: int, stop: int) -> TensorEntry:
    """Rows [start, stop) of a tensor: contiguous bytes of the file, read like a tensor."""
    if not 0 <= start <= stop <= e.shape[0]:
        raise CheckpointError(f"{e.path}: tensor {e.name} of shape {list(e.shape)} has no "
                              f"rows [{start}, {stop})")
    row_bytes = e.nbytes // e.shape[0] if e.shape[0] else 0
    return dataclasses.replace(e, shape=(stop - start, *e.shape[1:]),
                               offset=e.offset + start * row_bytes,
                               nbytes=(stop - start) * row_bytes)


def weight_bytes(w) -> int:
    """Bytes of weights this process holds, each tensor once (a tied lm_head, the norms
    a plain copy of a layer shares), of any family's weights: tensors found through
    dataclass fields and lists."""
    unique: dict[int, torch.Tensor] = {}

    def visit(obj) -> None:
        if obj is None:
            return
        if isinstance(obj, torch.Tensor):
            unique[id(obj)] = obj
        elif hasattr(obj, "tensors"):  # an int8 copy (small_linear.Int8Weight)
            for t in obj.tensors():
                unique[id(t)] = t
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif dataclasses.is_dataclass(obj):
            # not dataclasses.astuple: it deep-copies every weight
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name))
    visit(w)
    return sum(t.numel() * t.element_size() for t in unique.values())


# where a checkpoint keeps the decoder: a causal LM's "model.", or the text model
# inside Gemma3ForConditionalGeneration as transformers 5 saves it and as the Hub has it
TEXT_MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
# projections some checkpoints store fused (Phi-3) -> the parts they stack, in order
FUSED_IN_CHECKPOINT = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj",
                                              "self_attn.v_proj"),
                       "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def causal_lm_entries(entries: dict[str, TensorEntry], cfg: ModelConfig
                      ) -> dict[str, TensorEntry]:
    """The entries under a causal LM's names: the text model's prefix read as "model.",
    and fused projections entered as their parts (rows of the file, read like tensors
    of their own), so every family's loading and tensor-parallel slicing see one layout."""
    prefix = next((p for p in TEXT_MODEL_PREFIXES if p + "embed_tokens.weight" in entries),
                  "model.")
    if prefix != "model.":
        entries = {("model." + n[len(prefix):] if n.startswith(prefix) else n): e
                   for n, e in entries.items()}
    for i in range(cfg.num_layers):
        for fused, parts in FUSED_IN_CHECKPOINT.items():
            name = f"model.layers.{i}.{fused}.weight"
            if name not in entries:
                continue
            e, start = entries.pop(name), 0
            rows = _part_rows(fused, cfg)
            if sum(rows) != e.shape[0]:
                raise CheckpointError(f"{e.path}: {name} has {e.shape[0]} rows, the config "
                                      f"gives {' + '.join(map(str, rows))}")
            for part, n in zip(parts, rows):
                entries[f"model.layers.{i}.{part}.weight"] = row_slice(e, start, start + n)
                start += n
    return entries


def _part_rows(fused: str, cfg: ModelConfig) -> list[int]:
    if fused == "self_attn.qkv_proj":
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


class CheckpointSlices:
    """A checkpoint's tensors as one tensor-parallel rank reads them: each weight
    allocated once in its final (fused) place and read straight into it, no file
    mapping, no intermediate copies (see safetensors_io). Column-parallel parts are
    cut to this rank's rows by their name (q_proj, k_proj, v_proj: its heads;
    gate_proj, up_proj: its intermediate rows; embed_tokens, lm_head: its vocabulary);
    `columns` cuts row-parallel ones. Use inside `with TensorReader() as reader`.

    Every family's checkpoint comes through here: a quantized one's linears are
    dequantized by its method (worker_svc/model/quantization/) or refused by name,
    leftover quantized tensors are refused (checkpoint_checks), and a tensor taken must
    be a float dtype. (loading/gguf_quantized.QuantizedSlices: the same, its matmul
    weights kept as a GGUF's blocks.)"""
    holds_blocks = False  # matmul weights read as QuantWeights (gguf_quantized.py)

    def __init__(self, model_dir: Path, cfg: ModelConfig, plan: ShardPlan,
                 reader: TensorReader, dtype: torch.dtype, device: torch.device) -> None:
        self.model_dir, self.plan, self.reader = model_dir, plan, reader
        self.dtype, self.device = dtype, device
        entries = checkpoint_entries(model_dir)
        self.quant = quantization.method_of(model_dir, cfg.hf_config)  # refuses by name
        if self.quant is not None:
            entries, self.reader, taken = dequantized_entries(model_dir, entries,
                                                              self.quant, reader)
            if not taken:
                raise CheckpointError(
                    f"checkpoint in {model_dir} has quant_method={self.quant.quant_method!r} "
                    f"in {self.quant.source}, but no tensor in the {self.quant.name} format")
        refuse_unread_quantized(model_dir, entries,
                                self.quant.quant_method if self.quant else None)
        self.entries = causal_lm_entries(entries, cfg)
        hd = cfg.head_dim
        self.q_rows = (plan.q_heads[0] * hd, plan.q_heads[1] * hd)
        kv_rows = (plan.kv_heads[0] * hd, plan.kv_heads[1] * hd)
        # column-parallel rows of each fused part, by the part's name
        self.rows_of = {"q_proj": self.q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
                        "gate_proj": plan.intermediate, "up_proj": plan.intermediate,
                        "embed_tokens": plan.vocab, "lm_head": plan.vocab}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str, whole: bool = False) -> TensorEntry:
        """whole: the full tensor whatever its name (an expert's gate_proj is held whole
        by the rank that holds the expert)."""
        if name not in self.entries:
            raise KeyError(f"checkpoint in {self.model_dir} lacks tensor {name}")
        e = self.entries[name]
        refuse_non_float(name, e)
        part = name.rsplit(".", 2)[-2]  # "model.layers.0.self_attn.q_proj.weight" -> q_proj
        if whole or self.plan.whole or part not in self.rows_of or not e.shape:
            return e
        return row_slice(e, *self.rows_of[part])

    def take(self, name: str, dtype: torch.dtype | None = None, whole: bool = False
             ) -> torch.Tensor:
        e = self.entry(name, whole)
        out = new_tensor(e.shape, dtype or self.dtype, self.device)
        self.reader.read_into(e, out)
        return out

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.entries else None

    def fused(self, names: list[str], dtype: torch.dtype | None = None, whole: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """The parts stacked by rows into one tensor (into `out` if given)."""
        parts = [self.entry(n, whole) for n in names]
        if any(len(p.shape) == 0 or p.shape[1:] != parts[0].shape[1:] for p in parts):
            raise CheckpointError(f"checkpoint in {self.model_dir}: cannot stack {names} "
                                  f"with shapes {[list(p.shape) for p in parts]}")
        rows = sum(p.shape[0] for p in parts)
        if out is None:
            out = new_tensor((rows, *parts[0].shape[1:]), dtype or self.dtype, self.device)
        elif tuple(out.shape) != (rows, *parts[0].shape[1:]):
            raise CheckpointError(f"checkpoint in {self.model_dir}: {names} stack to "
                                  f"{[rows, *parts[0].shape[1:]]}, expected {list(out.shape)}")
        start = 0
        for p in parts:  # each part read into its rows of the fused tensor
            self.reader.read_into(p, out[start:start + p.shape[0]])
            start += p.shape[0]
        return out

    def fused_bias(self, names: list[str]) -> torch.Tensor | None:
        present = [n in self.entries for n in names]
        if not any(present):
            return None
        if not all(present):
            raise ValueError("a fused projection has a bias on some parts only")
        return self.fused(names)

    def columns(self, name: str, start: int, stop: int,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """Row-parallel: columns [start, stop) of every row, through one temporary
        the size of the whole tensor (strided bytes in the file)."""
        if self.plan.whole:
            return self.take(name, dtype)
        e = self.entry(name)
        if len(e.shape) != 2 or not 0 <= start <= stop <= e.shape[1]:
            raise CheckpointError(f"{e.path}: tensor {name} of shape {list(e.shape)} has "
                                  f"no columns [{start}, {stop})")
        tmp = torch.empty(e.shape, dtype=e.torch_dtype())
        self.reader.read_into(e, tmp)
        out = new_tensor((e.shape[0], stop - start), dtype or self.dtype, self.device)
        out.copy_(tmp[:, start:stop])
        return out

    def row_parallel_bias(self, name: str) -> torch.Tensor | None:
        return self.maybe(name) if self.plan.first else None  # added once, before the all-reduce

    def embed_and_head(self, tie: bool, dtype: torch.dtype | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.take("model.embed_tokens.weight", dtype)
        if tie or "lm_head.weight" not in self.entries:
            lm_head = embed  # one tensor for both; a stored tied copy is never read
        else:
            lm_head = self.take("lm_head.weight", dtype)
        if not tie and lm_head is embed:
            raise KeyError(f"checkpoint in {self.model_dir} lacks lm_head.weight (untied)")
        return embed, lm_head


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, plan: ShardPlan | None = None,
                 slices: type[CheckpointSlices] = CheckpointSlices) -> ModelWeights:
    """Llama, Mistral and Qwen2's fused weights (CheckpointSlices): this rank's slices
    with a tensor-parallel plan (see worker_svc.parallel.shard); `cfg` is the whole
    model's. slices: gguf_quantized.QuantizedSlices keeps a GGUF's blocks."""
    plan = plan or whole_plan(cfg)
    with TensorReader() as reader:
        ck = slices(model_dir, cfg, plan, reader, dtype, device)
        check_checkpoint(model_dir, cfg, ck.entries)  # quantized, non-float or misshapen
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layers.append(LayerWeights(
                input_norm=ck.take(p + "input_layernorm.weight"),
                qkv=ck.fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                qkv_bias=ck.fused_bias([a + "q_proj.bias", a + "k_proj.bias",
                                        a + "v_proj.bias"]),
                o_proj=ck.columns(a + "o_proj.weight", *ck.q_rows),
                o_bias=ck.row_parallel_bias(a + "o_proj.bias"),
                post_norm=ck.take(p + "post_attention_layernorm.weight"),
                gate_up=ck.fused([m + "gate_proj.weight", m + "up_proj.weight"]),
                gate_up_bias=ck.fused_bias([m + "gate_proj.bias", m + "up_proj.bias"]),
                down=ck.columns(m + "down_proj.weight", *plan.intermediate),
                down_bias=ck.row_parallel_bias(m + "down_proj.bias"),
            ))
        embed, lm_head = ck.embed_and_head(cfg.tie_word_embeddings)
        final_norm = ck.take("model.norm.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
