"""Read a checkpoint's safetensors (one file or sharded) into fused per-layer weights,
each weight allocated once and read straight into place (no mmap, no copies)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from worker_svc.model.config import ModelConfig
from worker_svc.model.safetensors_io import (CheckpointError, TensorEntry, TensorReader,
                                             new_tensor, read_header)


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


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> ModelWeights:
    """Each weight is allocated once in its final (fused) place and read straight into
    it: no file mapping, no intermediate copies (see safetensors_io)."""
    entries = checkpoint_entries(model_dir)

    def entry(name: str) -> TensorEntry:
        if name not in entries:
            raise KeyError(f"checkpoint in {model_dir} lacks tensor {name}")
        return entries[name]

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

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                qkv_bias=fused_bias([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
                o_proj=take(a + "o_proj.weight"),
                o_bias=maybe(a + "o_proj.bias"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=fused([m + "gate_proj.weight", m + "up_proj.weight"]),
                gate_up_bias=fused_bias([m + "gate_proj.bias", m + "up_proj.bias"]),
                down=take(m + "down_proj.weight"),
                down_bias=maybe(m + "down_proj.bias"),
            ))
        embed = take("model.embed_tokens.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in entries:
            lm_head = embed  # one tensor for both; a stored tied copy is never read
        else:
            lm_head = take("lm_head.weight")
        if not cfg.tie_word_embeddings and lm_head is embed:
            raise KeyError(f"checkpoint in {model_dir} lacks lm_head.weight (untied)")
        final_norm = take("model.norm.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)

