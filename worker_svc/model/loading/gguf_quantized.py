"""A GGUF's llama-family weights on the quantized path: every matmul weight and the
embedding kept as the file's blocks (model/cpu/quant_weights.QuantWeight), norms as
float32 (they are F32 in the file). No value is widened at load: a load is a read of
the file's bytes, not a dequantization.

The names, the q/k row order and the checks are the exact path's (CheckpointSlices
over gguf_tensors' entries); only the matmul tensors take another road. A tensor of a
type the kernel does not read (Q2_K, Q3_K) is widened to an F32 segment here, through
the exact path's dequantization: served right, at fp32's size (the start log counts it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from worker_svc.model.config import ModelConfig
from worker_svc.model.cpu.quant_weights import TYPES, QuantWeight, concat
from worker_svc.model.loading.checkpoint_checks import check_checkpoint
from worker_svc.model.loading.gguf_tensors import dequantized, quantized_rows
from worker_svc.model.loading.safetensors_io import TensorEntry, TensorReader
from worker_svc.model.loading.weights import CheckpointSlices, LayerWeights, ModelWeights
from worker_svc.parallel.shard import whole_plan


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


def load_quantized_weights(model_dir: Path, cfg: ModelConfig) -> ModelWeights:
    """The whole model (one rank) with QuantWeights where the exact path has fp32."""
    with TensorReader() as reader:
        ck = CheckpointSlices(model_dir, cfg, whole_plan(cfg), reader, torch.float32,
                              torch.device("cpu"))
        check_checkpoint(model_dir, cfg, ck.entries)
        q = lambda name: _quant(ck.entry(name))  # noqa: E731
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layers.append(LayerWeights(
                input_norm=ck.take(p + "input_layernorm.weight"),
                qkv=concat([q(a + "q_proj.weight"), q(a + "k_proj.weight"),
                            q(a + "v_proj.weight")]),
                qkv_bias=ck.fused_bias([a + "q_proj.bias", a + "k_proj.bias",
                                        a + "v_proj.bias"]),
                o_proj=q(a + "o_proj.weight"), o_bias=ck.maybe(a + "o_proj.bias"),
                post_norm=ck.take(p + "post_attention_layernorm.weight"),
                gate_up=concat([q(m + "gate_proj.weight"), q(m + "up_proj.weight")]),
                gate_up_bias=ck.fused_bias([m + "gate_proj.bias", m + "up_proj.bias"]),
                down=q(m + "down_proj.weight"), down_bias=ck.maybe(m + "down_proj.bias")))
        embed = q("model.embed_tokens.weight")
        lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in ck \
            else q("lm_head.weight")
        final_norm = ck.take("model.norm.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def held_types(weights: ModelWeights) -> dict[str, int]:
    """GGUF type -> bytes held in it, over every quantized weight (the start log's)."""
    seen: dict[int, tuple[str, int]] = {}
    for w in [weights.embed, weights.lm_head, *(getattr(lw, n) for lw in weights.layers
                                                 for n in ("qkv", "o_proj", "gate_up", "down"))]:
        for kind, data in w.segments:
            seen[id(data)] = (kind, data.numel())
    out: dict[str, int] = {}
    for kind, n in seen.values():
        out[kind] = out.get(kind, 0) + n
    return out
