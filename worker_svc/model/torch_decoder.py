"""The torch path: a pre-norm decoder built only from layers.py, for every family the
C kernels do not run (registry.py). A family module subclasses TorchDecoder where its
layer differs (override `attention`, `mlp` or the whole `layer`) and declares its
checkpoint names in a PACKED_MODULES_MAPPING that `load_weights` reads.

Like llama.py, one call runs every scheduled token of a step (prefill chunks and
decodes of many requests flattened into [num_tokens]) over the paged KV cache, and
under tensor parallelism each rank holds its heads, its MLP rows and its experts
(worker_svc/parallel/shard.py); the row-parallel outputs are all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from worker_svc.kv_capacity import kv_cache_tensors
from worker_svc.model import layers
from worker_svc.model.loading.checkpoint_checks import check_shapes
from worker_svc.model.config import ModelConfig, layer_windows
from worker_svc.model.layers import MoeWeights
from worker_svc.model.loading.safetensors_io import TensorReader
from worker_svc.model.loading.weights import CheckpointSlices
from worker_svc.parallel.shard import ShardPlan, whole_plan


@dataclass(slots=True)
class DenseMLP:
    gate_up: torch.Tensor  # [gate; up] rows fused
    down: torch.Tensor


@dataclass(slots=True)
class TorchLayer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q; k; v] rows fused
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # per-head RMSNorm weights [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    mlp: DenseMLP | MoeWeights


@dataclass(slots=True)
class TorchWeights:
    embed: torch.Tensor
    layers: list[TorchLayer]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding itself when tied


# Our weight -> the checkpoint tensors it is read from, relative to "model.layers.{i}."
# (".weight" appended); a family module states its own in this shape. "{e}" stands
# for an expert's index. Tuples of several names stack by rows into one fused weight.
LLAMA_NAMES: dict[str, tuple[str, ...]] = {
    "input_norm": ("input_layernorm",),
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "post_norm": ("post_attention_layernorm",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 shard: ShardPlan | None, matmul_dtype: torch.dtype | None,
                 names: dict[str, tuple[str, ...]],
                 slices: type[CheckpointSlices] = CheckpointSlices) -> TorchWeights:
    """This rank's weights (`cfg` the whole model's): norms in the activation dtype
    `dtype`, matmul weights in `matmul_dtype` (bf16 on CPU stays bf16, as cpu_dtype's).
    `names` is the family's PACKED_MODULES_MAPPING (LLAMA_NAMES' keys, plus q_norm and
    k_norm, and router, expert_gate_up and expert_down for routed-experts layers).
    slices: how the checkpoint is read (gguf_quantized.QuantizedSlices keeps a GGUF's
    matmul weights as its blocks)."""
    shard = shard or whole_plan(cfg)
    mm = matmul_dtype or dtype
    with TensorReader() as reader:
        ck = slices(model_dir, cfg, shard, reader, dtype, device)
        check_shapes(model_dir, ck.entries, expected_shapes(cfg, names))

        def w(prefix: str, key: str) -> list[str]:
            return [f"{prefix}{n}.weight" for n in names[key]]

        def b(prefix: str, key: str) -> list[str]:
            return [f"{prefix}{n}.bias" for n in names[key]]

        out = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qk_norm = cfg.qk_norm
            moe_layer = bool(cfg.moe_layers) and cfg.moe_layers[i]
            if moe_layer:
                mlp = _experts(ck, p, names, cfg, shard, mm)
            else:
                mlp = DenseMLP(gate_up=ck.fused(w(p, "gate_up"), mm),
                               down=ck.columns(w(p, "down")[0], *shard.intermediate, mm))
            out.append(TorchLayer(
                input_norm=ck.take(w(p, "input_norm")[0]),
                qkv=ck.fused(w(p, "qkv"), mm),
                qkv_bias=ck.fused_bias(b(p, "qkv")) if cfg.qkv_bias else None,
                o_proj=ck.columns(w(p, "o_proj")[0], *ck.q_rows, mm),
                o_bias=ck.row_parallel_bias(b(p, "o_proj")[0]),
                q_norm=ck.take(w(p, "q_norm")[0]) if qk_norm else None,
                k_norm=ck.take(w(p, "k_norm")[0]) if qk_norm else None,
                post_norm=ck.take(w(p, "post_norm")[0]),
                mlp=mlp))
        embed, lm_head = ck.embed_and_head(cfg.tie_word_embeddings, mm)
        final_norm = ck.take("model.norm.weight")
    return TorchWeights(embed=embed, layers=out, final_norm=final_norm, lm_head=lm_head)


def expected_shapes(cfg: ModelConfig, names: dict[str, tuple[str, ...]]
                    ) -> dict[str, tuple[int, ...]]:
    """The layers' tensors a family's PACKED_MODULES_MAPPING names, with the shapes the
    config implies (checkpoint_checks.check_shapes); biases are checked when stacked."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    per_key = {"input_norm": [(h,)], "post_norm": [(h,)], "qkv": [(q, h), (kv, h), (kv, h)],
               "o_proj": [(h, q)], "q_norm": [(hd,)], "k_norm": [(hd,)],
               "gate_up": [(cfg.intermediate_size, h)] * 2,
               "down": [(h, cfg.intermediate_size)]}
    if cfg.moe is not None:
        mi = cfg.moe.intermediate_size
        per_key |= {"router": [(cfg.moe.num_experts, h)], "expert_gate_up": [(mi, h)] * 2,
                    "expert_down": [(h, mi)]}
        si = cfg.moe.shared_intermediate_size
        per_key |= {"shared_gate_up": [(si, h)] * 2, "shared_down": [(h, si)],
                    "shared_gate": [(1, h)]}
    out: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_layers):
        moe_layer = bool(cfg.moe_layers) and cfg.moe_layers[i]
        skip = ({"gate_up", "down"} if moe_layer else {"router", "expert_gate_up",
                                                       "expert_down", "shared_gate_up",
                                                       "shared_down", "shared_gate"})
        if not cfg.qk_norm:
            skip |= {"q_norm", "k_norm"}
        for key, shapes in per_key.items():
            if key in skip or key not in names:
                continue
            experts = range(cfg.moe.num_experts) if key.startswith("expert_") else [None]
            for e in experts:
                for n, shape in zip(names[key], shapes):
                    out[f"model.layers.{i}.{n.format(e=e)}.weight"] = shape
    return out


def _experts(ck: CheckpointSlices, p: str, names, cfg: ModelConfig, shard: ShardPlan,
             dtype: torch.dtype) -> MoeWeights:
    """The router whole and this rank's experts whole, each expert's [gate; up] read
    into its slice of one [local experts, 2 * intermediate, hidden] tensor (a list of
    per-expert QuantWeights when the slices hold a GGUF's blocks)."""
    first, stop = shard.experts
    inter, hidden = cfg.moe.intermediate_size, cfg.hidden_size
    gate_up_names = [[f"{p}{n.format(e=e)}.weight" for n in names["expert_gate_up"]]
                     for e in range(first, stop)]
    down_names = [[f"{p}{names['expert_down'][0].format(e=e)}.weight"]
                  for e in range(first, stop)]
    if ck.holds_blocks:
        gate_up = [ck.fused(n, whole=True) for n in gate_up_names]
        down = [ck.fused(n, whole=True) for n in down_names]
    else:
        gate_up = torch.empty(stop - first, 2 * inter, hidden, dtype=dtype, device=ck.device)
        down = torch.empty(stop - first, hidden, inter, dtype=dtype, device=ck.device)
        for j in range(stop - first):
            ck.fused(gate_up_names[j], whole=True, out=gate_up[j])
            ck.fused(down_names[j], whole=True, out=down[j])
    shared = {}
    if cfg.moe.shared_intermediate_size and first == 0:  # Qwen2-MoE's shared expert
        shared = dict(
            shared_gate_up=ck.fused([f"{p}{n}.weight" for n in names["shared_gate_up"]],
                                    dtype, whole=True),
            shared_down=ck.fused([f"{p}{names['shared_down'][0]}.weight"], dtype, whole=True),
            shared_gate=ck.take(f"{p}{names['shared_gate'][0]}.weight", dtype, whole=True))
    router = ck.take(f"{p}{names['router'][0]}.weight", dtype, whole=True)
    if tuple(router.shape) != (cfg.moe.num_experts, hidden):
        raise ValueError(f"router {p}{names['router'][0]} has shape {list(router.shape)}, "
                         f"expected [{cfg.moe.num_experts}, {hidden}]")
    return MoeWeights(router=router, gate_up=gate_up, down=down, first=first, **shared)


def _unchanged(t: torch.Tensor) -> torch.Tensor:
    return t


class TorchDecoder:
    """A pre-norm decoder: x += attention(norm(x)); x += mlp(norm(x)), then the final
    norm and the vocabulary projection of the rows that sample."""

    def __init__(self, cfg: ModelConfig, weights: TorchWeights, backend, max_positions: int,
                 plan, tp=None) -> None:
        """cfg: the model as this rank holds it (ShardPlan.local_config); plan: the
        worker's ComputePlan; tp: the tensor-parallel group, None when unsplit."""
        self.cfg, self.w, self.backend, self.tp = cfg, weights, backend, tp
        self.dtype = plan.act_dtype
        self.scale = cfg.head_dim ** -0.5
        self._reduce = tp.all_reduce if tp is not None else _unchanged
        self.cos, self.sin = layers.rope_tables(cfg.inv_freq, cfg.rope_scaling, cfg.head_dim,
                                                max_positions, weights.embed.device, self.dtype,
                                                cfg.long_inv_freq, cfg.long_from)
        if cfg.long_from is not None:  # longrope: rows max_positions on rotate all long
            cos, sin = layers.rope_tables(cfg.long_inv_freq, cfg.rope_scaling, cfg.head_dim,
                                          max_positions, weights.embed.device, self.dtype)
            self.cos, self.sin = torch.cat([self.cos, cos]), torch.cat([self.sin, sin])
        # each layer's sliding window, None where it attends to every key
        self.windows = layer_windows(cfg, max_positions)
        self.screen_rows = {"screened": 0, "full": 0}  # no screen on this path
        # tokens routed to each expert this rank holds, summed over layers (a metric:
        # gapserve:worker_moe_expert_tokens); empty without routed experts
        self.expert_tokens = [0] * (cfg.moe.num_experts if cfg.moe is not None else 0)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        c = self.cfg
        return kv_cache_tensors(c.num_layers, (2, num_blocks, block_size, c.num_kv_heads,
                                               c.head_dim), self.dtype, self.w.embed.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta, logits_indices: torch.Tensor,
                argmax_only: bool = False) -> torch.Tensor | None:
        """Logits [len(logits_indices), vocab] fp32 of the rows that sample (rank 0's;
        None on the other ranks). argmax_only is a hint this path does not use."""
        rope = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        x = layers.vocab_parallel_embed(input_ids, self.w.embed, self.dtype, self.tp)
        for i, lw in enumerate(self.w.layers):
            x = self.layer(i, lw, x, rope, kv_caches[i], meta)
        x = layers.rms_norm(x[logits_indices], self.w.final_norm, self.cfg.rms_norm_eps)
        return layers.gathered_logits(layers.linear(x, self.w.lm_head), self.tp,
                                      self.cfg.vocab_size)

    def layer(self, i: int, lw: TorchLayer, x: torch.Tensor, rope, kv_cache: torch.Tensor,
              meta) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        x = x + self._reduce(self.attention(lw, layers.rms_norm(x, lw.input_norm, eps),
                                            rope, kv_cache, meta, self.windows[i]))
        return x + self._reduce(self.mlp(i, lw, layers.rms_norm(x, lw.post_norm, eps)))

    def attention(self, lw: TorchLayer, h: torch.Tensor, rope, kv_cache: torch.Tensor,
                  meta, window: int | None = None, softcap: float | None = None,
                  norm=layers.rms_norm) -> torch.Tensor:
        """o_proj(attention(rope(q), rope(k), v)): a row-parallel partial sum; q and k
        go through their per-head norms (`norm`) first where the family has them;
        window: the layer's sliding window; softcap: the scores' cap (Gemma 2)."""
        c, n = self.cfg, h.shape[0]
        nq, nkv, hd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        qkv = layers.linear(h, lw.qkv, lw.qkv_bias)
        q = qkv[:, :nq].view(n, c.num_heads, hd)
        k = qkv[:, nq:nq + nkv].view(n, c.num_kv_heads, hd)
        v = qkv[:, nq + nkv:].view(n, c.num_kv_heads, hd)
        if lw.q_norm is not None:
            q = norm(q, lw.q_norm, c.rms_norm_eps)
            k = norm(k, lw.k_norm, c.rms_norm_eps)
        q, k = layers.apply_rope(q, *rope), layers.apply_rope(k, *rope)
        attn = layers.paged_attention(self.backend, q, k, v, kv_cache, meta, self.scale,
                                      window, softcap)
        return layers.linear(attn.reshape(n, nq), lw.o_proj, lw.o_bias)

    def mlp(self, i: int, lw: TorchLayer, h: torch.Tensor) -> torch.Tensor:
        """The dense gated MLP, or the routed experts (layers.moe): a partial sum."""
        if isinstance(lw.mlp, MoeWeights):
            return layers.moe(h, lw.mlp, self.cfg.moe, tally=self.expert_tokens)
        return layers.gated_mlp(h, lw.mlp.gate_up, lw.mlp.down)
