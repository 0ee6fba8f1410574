"""Gemma 2 and Gemma 3 (text): `gemma2`, `gemma3_text` and the text model of `gemma3`
(Gemma3ForConditionalGeneration; weights.causal_lm_entries reads its
`language_model` names), on the torch path (torch_decoder.py); Gemma 3's decode steps
on a GGUF's blocks run one C call instead (model/cpu/decode_layers.GemmaDecodeLayers:
the same layer, each norm's 1 + w added once, each layer's RoPE table and window).

Where the layer differs from Llama's, each as transformers 5 computes it: RMSNorms
that scale by (1 + w); the embedding scaled by sqrt(hidden_size) in the activation
dtype; a norm on the attention's output and on the feed-forward's input and output;
per-head q/k norms (Gemma 3); GeGLU with the tanh GELU; 1 / sqrt(query_pre_attn_scalar)
as the attention scale; sliding and global layers in the config's layer_types, Gemma
3's sliding ones rotating with their own base (rope_local_base_freq); attention
scores soft-capped for Gemma 2 (transformers computes Gemma 3's attention without its
attn_logit_softcapping, so we do too) and the final logits soft-capped where the
config sets final_logit_softcapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker_svc.model import layers, torch_decoder
from worker_svc.model.cpu import decode_layers, fused_ops
from worker_svc.model.config import ModelConfig
from worker_svc.model.loading.safetensors_io import TensorReader
from worker_svc.model.loading.weights import CheckpointSlices
from worker_svc.parallel.shard import whole_plan

ACTIVATION = "gelu_pytorch_tanh"
PACKED_MODULES_MAPPING = {**torch_decoder.LLAMA_NAMES,
                          "q_norm": ("self_attn.q_norm",), "k_norm": ("self_attn.k_norm",)}
# the feed-forward's own norms, read beside torch_decoder's layer (GemmaWeights)
FFN_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def configure(hf, cfg: ModelConfig) -> ModelConfig:
    """Refuse, by name, what this forward does not compute; Gemma's layer fields."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    if act != ACTIVATION:
        raise ValueError(f"unsupported hidden_activation {act!r} for {hf.model_type}; "
                         f"only {ACTIVATION}")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"{hf.model_type} with use_bidirectional_attention (an embedding "
                         "model) is not supported: gapserve serves causal LMs")
    types = list(getattr(hf, "layer_types", None) or ())
    if set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"unsupported layer_types {sorted(set(types))} for {hf.model_type}")
    if hf.model_type == "gemma3_text":
        local = hf.rope_parameters.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {local['rope_type']!r} for Gemma 3's "
                             "sliding layers; only default")
        cfg.qk_norm = True
    cfg.qkv_bias = bool(getattr(hf, "attention_bias", False))
    if getattr(hf, "sliding_window", None) and "sliding_attention" in types:
        cfg.sliding_window = int(hf.sliding_window)
        cfg.sliding_layers = tuple(t == "sliding_attention" for t in types)
    return cfg


@dataclass(slots=True)
class GemmaWeights(torch_decoder.TorchWeights):
    pre_ffn_norms: list = field(default_factory=list)  # per layer, [hidden]
    post_ffn_norms: list = field(default_factory=list)


def load_weights(model_dir, cfg, dtype, device, shard=None, matmul_dtype=None,
                 slices=CheckpointSlices):
    base = torch_decoder.load_weights(model_dir, cfg, dtype, device, shard, matmul_dtype,
                                      PACKED_MODULES_MAPPING, slices)
    with TensorReader() as reader:  # the norms are whole on every rank
        ck = CheckpointSlices(model_dir, cfg, shard or whole_plan(cfg), reader, dtype, device)
        pre, post = ([ck.take(f"model.layers.{i}.{n}.weight") for i in range(cfg.num_layers)]
                     for n in FFN_NORMS)
    return GemmaWeights(embed=base.embed, layers=base.layers, final_norm=base.final_norm,
                        lm_head=base.lm_head, pre_ffn_norms=pre, post_ffn_norms=post)


class Model(torch_decoder.TorchDecoder):
    def __init__(self, cfg, weights: GemmaWeights, backend, max_positions: int, plan,
                 tp=None) -> None:
        super().__init__(cfg, weights, backend, max_positions, plan, tp)
        hf = cfg.hf_config
        self.scale = float(hf.query_pre_attn_scalar) ** -0.5
        self.attn_softcap = hf.attn_logit_softcapping if cfg.model_type == "gemma2" else None
        self.final_softcap = getattr(hf, "final_logit_softcapping", None)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=self.dtype)
        # the global layers rotate with cfg.inv_freq (TorchDecoder's tables); Gemma 3's
        # sliding layers with rope_local_base_freq
        local = (self.cos, self.sin)
        if cfg.model_type == "gemma3_text" and cfg.sliding_layers:
            theta = hf.rope_parameters["sliding_attention"]["rope_theta"]
            d = cfg.head_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
            local = layers.rope_tables(inv_freq, 1.0, d, max_positions, self.cos.device,
                                       self.dtype)
        sliding = cfg.sliding_layers or (False,) * cfg.num_layers
        self.tables = [local, (self.cos, self.sin)]
        self.layer_table = [0 if s else 1 for s in sliding]
        # decode steps on a GGUF's blocks: every layer in one C call (compute_plan.py)
        self.decode_layers = None
        if plan.decode_layers:
            self.decode_layers = decode_layers.GemmaDecodeLayers.build(
                cfg, weights.layers, (weights.pre_ffn_norms, weights.post_ffn_norms),
                [self.tables[t] for t in self.layer_table], self.windows)
            if self.decode_layers is None:
                raise RuntimeError("the compute plan's C layer loop cannot take this model")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta, logits_indices: torch.Tensor,
                argmax_only: bool = False) -> torch.Tensor | None:
        x = layers.vocab_parallel_embed(input_ids, self.w.embed, self.dtype, self.tp)
        x = x * self.embed_scale
        loop = self._decode_loop(input_ids, positions, meta, kv_caches)
        if loop is not None:  # the loop below, in one C call
            x += self.decode_layers.run(x, positions, meta.slot_mapping, kv_caches, loop)
        else:
            ropes = [(cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                     for cos, sin in self.tables]
            for i, lw in enumerate(self.w.layers):
                x = self.layer(i, lw, x, ropes[self.layer_table[i]], kv_caches[i], meta)
        x = layers.rms_norm_one_plus(x[logits_indices], self.w.final_norm,
                                     self.cfg.rms_norm_eps)
        logits = layers.gathered_logits(layers.linear(x, self.w.lm_head), self.tp,
                                        self.cfg.vocab_size)
        if logits is not None and self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _decode_loop(self, input_ids, positions, meta, kv_caches):
        """The step's C decode attention plan when the C layer loop takes this step
        (every row a single-token decode), else None."""
        plan = getattr(self.backend, "decode_kernel_plan", None)
        if self.decode_layers is None or plan is None \
                or not fused_ops.takes(input_ids, positions, meta.slot_mapping):
            return None
        return plan(meta, self.cfg.num_heads, kv_caches[0], self.scale)

    def layer(self, i: int, lw, x: torch.Tensor, rope, kv_cache: torch.Tensor,
              meta) -> torch.Tensor:
        norm, eps = layers.rms_norm_one_plus, self.cfg.rms_norm_eps
        attn = self.attention(lw, norm(x, lw.input_norm, eps), rope, kv_cache, meta,
                              self.windows[i], self.attn_softcap, norm=norm)
        x = x + norm(self._reduce(attn), lw.post_norm, eps)
        h = norm(x, self.w.pre_ffn_norms[i], eps)
        mlp = layers.gated_mlp(h, lw.mlp.gate_up, lw.mlp.down, layers.gelu_tanh_and_mul)
        return x + norm(self._reduce(mlp), self.w.post_ffn_norms[i], eps)
