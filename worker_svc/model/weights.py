"""Read a checkpoint's safetensors (one file or sharded) into fused per-layer weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from worker_svc.model.config import ModelConfig


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


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> ModelWeights:
    raw: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                raw[name] = f.get_tensor(name)

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise KeyError(f"checkpoint in {model_dir} lacks tensor {name}")
        return raw.pop(name).to(device=device, dtype=dtype).contiguous()

    def maybe(name: str) -> torch.Tensor | None:
        return take(name) if name in raw else None

    def cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ValueError("a fused projection has a bias on some parts only")
        return torch.cat(parts).contiguous()

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"),
                     take(a + "v_proj.weight")]),
            qkv_bias=cat([maybe(a + "q_proj.bias"), maybe(a + "k_proj.bias"),
                          maybe(a + "v_proj.bias")]),
            o_proj=take(a + "o_proj.weight"),
            o_bias=maybe(a + "o_proj.bias"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]),
            gate_up_bias=cat([maybe(m + "gate_proj.bias"), maybe(m + "up_proj.bias")]),
            down=take(m + "down_proj.weight"),
            down_bias=maybe(m + "down_proj.bias"),
        ))
    embed = take("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in raw \
        else take("lm_head.weight")
    if not cfg.tie_word_embeddings and lm_head is embed:
        raise KeyError(f"checkpoint in {model_dir} lacks lm_head.weight (untied)")
    return ModelWeights(embed=embed, layers=layers,
                        final_norm=take("model.norm.weight"), lm_head=lm_head)
