"""Read a checkpoint's safetensors (one file or sharded) into fused per-layer weights,
each weight allocated once and read straight into place (no mmap, no copies)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from worker_svc.model.config import ModelConfig
from worker_svc.model.safetensors_io import (CheckpointError, TensorEntry, TensorReader,
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
    # Gemma: norms of the feed-forward's input and output, and per-head q/k norms
    pre_ffn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


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
    """Where every tensor of the checkpoint lies, from the headers of all its files."""
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


# where the decoder's tensors sit: a causal LM's, or the text model's inside
# Gemma3ForConditionalGeneration as transformers 5 saves it and as the Hub stores it
TEXT_MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def _text_model_prefix(entries: dict[str, TensorEntry]) -> str:
    for prefix in TEXT_MODEL_PREFIXES:
        if prefix + "embed_tokens.weight" in entries:
            return prefix
    raise KeyError("checkpoint lacks the token embedding (tried "
                   f"{', '.join(p + 'embed_tokens.weight' for p in TEXT_MODEL_PREFIXES)})")


def _unfuse(entries: dict[str, TensorEntry], cfg: ModelConfig, prefix: str) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj, entered as the parts they stack (rows
    of the file, read like tensors of their own), so loading and tensor-parallel
    slicing see one layout."""
    from worker_svc.model import phi3
    for i in range(cfg.num_layers):
        for fused, parts in phi3.FUSED.items():
            name = f"{prefix}layers.{i}.{fused}.weight"
            if name not in entries:
                continue
            e, start = entries.pop(name), 0
            rows = phi3.part_rows(fused, cfg)
            if sum(rows) != e.shape[0]:
                raise CheckpointError(f"{e.path}: {name} has {e.shape[0]} rows, the config "
                                      f"gives {' + '.join(map(str, rows))}")
            for part, n in zip(parts, rows):
                entries[f"{prefix}layers.{i}.{part}.weight"] = row_slice(e, start, start + n)
                start += n


def weight_bytes(w: ModelWeights) -> int:
    """Bytes of weights this process holds, each tensor once (a tied lm_head, the norms
    a plain copy of a layer shares)."""
    tensors = [w.embed, w.final_norm, w.lm_head, w.plain_lm_head, w.argmax_screen]
    for lw in [*w.layers, *(w.plain_layers or ())]:
        # not dataclasses.astuple: it deep-copies every weight
        tensors += [getattr(lw, f.name) for f in dataclasses.fields(lw)]
    # an int8 copy (small_linear.Int8Weight) is its values and its scales
    tensors = [part for t in tensors if t is not None
               for part in (t.tensors() if hasattr(t, "tensors") else (t,))]
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, plan: ShardPlan | None = None) -> ModelWeights:
    """Each weight is allocated once in its final (fused) place and read straight into
    it: no file mapping, no intermediate copies (see safetensors_io). With a
    tensor-parallel plan, only this rank's slices are allocated and read (see
    worker_svc.parallel.shard); `cfg` is the whole model's."""
    entries = checkpoint_entries(model_dir)
    prefix = _text_model_prefix(entries)
    _unfuse(entries, cfg, prefix)
    plan = plan or whole_plan(cfg)
    hd = cfg.head_dim
    q_rows = (plan.q_heads[0] * hd, plan.q_heads[1] * hd)
    kv_rows = (plan.kv_heads[0] * hd, plan.kv_heads[1] * hd)
    # column-parallel rows of each fused part, by the part's name
    rows_of = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
               "gate_proj": plan.intermediate, "up_proj": plan.intermediate,
               "embed_tokens": plan.vocab, "lm_head": plan.vocab}

    def entry(name: str) -> TensorEntry:
        if name not in entries:
            raise KeyError(f"checkpoint in {model_dir} lacks tensor {name}")
        e = entries[name]
        part = name.rsplit(".", 2)[-2]  # "model.layers.0.self_attn.q_proj.weight" -> q_proj
        if plan.whole or part not in rows_of or not e.shape:
            return e
        return row_slice(e, *rows_of[part])

    with TensorReader() as reader:
        def take(name: str) -> torch.Tensor:
            e = entry(name)
            out = new_tensor(e.shape, dtype, device)
            reader.read_into(e, out)
            return out

        def fused(names: list[str]) -> torch.Tensor:
            parts = [entry(n) for n in names]
            if any(len(p.shape) == 0 or p.shape[1:] != parts[0].shape[1:] for p in parts):
                raise CheckpointError(f"checkpoint in {model_dir}: cannot stack {names} "
                                      f"with shapes {[list(p.shape) for p in parts]}")
            rows = sum(p.shape[0] for p in parts)
            out = new_tensor((rows, *parts[0].shape[1:]), dtype, device)
            start = 0
            for p in parts:  # each part read into its rows of the fused tensor
                reader.read_into(p, out[start:start + p.shape[0]])
                start += p.shape[0]
            return out

        def fused_bias(names: list[str]) -> torch.Tensor | None:
            present = [n in entries for n in names]
            if not any(present):
                return None
            if not all(present):
                raise ValueError("a fused projection has a bias on some parts only")
            return fused(names)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in entries else None

        def columns(name: str, start: int, stop: int) -> torch.Tensor:
            """Row-parallel: columns [start, stop) of every row, through one temporary
            the size of the whole tensor (strided bytes in the file)."""
            if plan.whole:
                return take(name)
            e = entry(name)
            if len(e.shape) != 2 or not 0 <= start <= stop <= e.shape[1]:
                raise CheckpointError(f"{e.path}: tensor {name} of shape {list(e.shape)} has "
                                      f"no columns [{start}, {stop})")
            tmp = torch.empty(e.shape, dtype=e.torch_dtype())
            reader.read_into(e, tmp)
            out = new_tensor((e.shape[0], stop - start), dtype, device)
            out.copy_(tmp[:, start:stop])
            return out

        def row_parallel_bias(name: str) -> torch.Tensor | None:
            return maybe(name) if plan.first else None  # added once, before the all-reduce

        def norm(name: str) -> torch.Tensor:
            # Gemma's norms scale by (1 + w): folded in once here, the forward is RMSNorm's
            t = take(name)
            return t.add_(1.0) if cfg.family == "gemma" else t

        def maybe_norm(name: str) -> torch.Tensor | None:
            return norm(name) if name in entries else None

        layers = []
        for i in range(cfg.num_layers):
            p = f"{prefix}layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layers.append(LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                qkv_bias=fused_bias([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
                o_proj=columns(a + "o_proj.weight", *q_rows),
                o_bias=row_parallel_bias(a + "o_proj.bias"),
                post_norm=norm(p + "post_attention_layernorm.weight"),
                gate_up=fused([m + "gate_proj.weight", m + "up_proj.weight"]),
                gate_up_bias=fused_bias([m + "gate_proj.bias", m + "up_proj.bias"]),
                down=columns(m + "down_proj.weight", *plan.intermediate),
                down_bias=row_parallel_bias(m + "down_proj.bias"),
                pre_ffn_norm=maybe_norm(p + "pre_feedforward_layernorm.weight"),
                post_ffn_norm=maybe_norm(p + "post_feedforward_layernorm.weight"),
                q_norm=maybe_norm(a + "q_norm.weight"),
                k_norm=maybe_norm(a + "k_norm.weight"),
            ))
        if cfg.family == "gemma" and any(lw.pre_ffn_norm is None for lw in layers):
            raise KeyError(f"checkpoint in {model_dir} lacks Gemma's feed-forward norms "
                           f"({prefix}layers.N.pre_feedforward_layernorm.weight)")
        embed = take(prefix + "embed_tokens.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in entries:
            lm_head = embed  # one tensor for both; a stored tied copy is never read
        else:
            lm_head = take("lm_head.weight")
        if not cfg.tie_word_embeddings and lm_head is embed:
            raise KeyError(f"checkpoint in {model_dir} lacks lm_head.weight (untied)")
        final_norm = norm(prefix + "norm.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)

