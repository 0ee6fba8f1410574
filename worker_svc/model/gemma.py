"""Gemma 2 and Gemma 3 (text): the decoder forward for `gemma2`, `gemma3_text` and the
text model of `gemma3` (Gemma3ForConditionalGeneration) checkpoints.

What sets the layer apart from Llama's (model/llama.py), each as transformers does it:
RMSNorms that scale by (1 + w) (folded into the weights at load, model/weights.py);
the embedding scaled by sqrt(hidden_size) in the activation dtype; a norm on the
attention's output and on the feed-forward's input and output; per-head q/k norms
(Gemma 3); GeGLU with the tanh GELU; 1 / sqrt(query_pre_attn_scalar) as the
attention scale; sliding and global layers in the config's layer_types, Gemma 3's
sliding ones rotating with their own base (rope_local_base_freq); attention scores
soft-capped (Gemma 2: transformers 5 computes Gemma 3's attention without its cap,
so we do too) and the final logits soft-capped where the config sets it. Torch ops
only: the compute plan gives this family no C layer ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.model.llama import DecoderModel, _rms_norm
from worker_svc.model.rope import apply_rope, rope_tables

ACTIVATION = "gelu_pytorch_tanh"


def check_config(hf) -> None:
    """Refuse, by name, what this forward does not compute."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    if act != ACTIVATION:
        raise ValueError(f"unsupported hidden_activation {act!r} for {hf.model_type}; "
                         f"only {ACTIVATION}")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"{hf.model_type} with use_bidirectional_attention (an embedding "
                         "model) is not supported: gapserve serves causal LMs")
    if hf.model_type == "gemma3_text":
        local = hf.rope_parameters.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {local['rope_type']!r} for Gemma 3's "
                             "sliding layers; only default")
    types = set(getattr(hf, "layer_types", None) or ())
    if types - {"sliding_attention", "full_attention"}:
        raise ValueError(f"unsupported layer_types {sorted(types)} for {hf.model_type}")


class GemmaModel(DecoderModel):
    def __init__(self, cfg, weights, backend, max_positions: int, plan, tp=None) -> None:
        super().__init__(cfg, weights, backend, max_positions, plan, tp)
        hf = cfg.hf_config
        self.scale = float(hf.query_pre_attn_scalar) ** -0.5
        # transformers 5 passes the attention cap to Gemma 2's attention only
        self.attn_softcap = hf.attn_logit_softcapping if cfg.model_type == "gemma2" else None
        self.final_softcap = getattr(hf, "final_logit_softcapping", None)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=self.dtype)
        # the global layers' tables are DecoderModel's (cfg.inv_freq); Gemma 3's sliding
        # layers rotate with rope_local_base_freq
        local = (self.cos, self.sin)
        if cfg.model_type == "gemma3_text" and cfg.sliding_layers:
            theta = hf.rope_parameters["sliding_attention"]["rope_theta"]
            d = cfg.head_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
            cos, sin = rope_tables(inv_freq, 1.0, max_positions)
            local = tuple(t.to(device=self.cos.device, dtype=self.dtype) for t in (cos, sin))
        sliding = cfg.sliding_layers or (False,) * cfg.num_layers
        self.layer_rope = [local if s else (self.cos, self.sin) for s in sliding]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                logits_indices: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        c, w = self.cfg, self.w
        n, hd, eps = input_ids.shape[0], c.head_dim, c.rms_norm_eps
        nq, nkv = c.num_heads * hd, c.num_kv_heads * hd
        inter = c.intermediate_size
        write_kv, attention = self.backend.write_kv, self.backend.attention
        ropes = {id(t): (t[0][positions].unsqueeze(1), t[1][positions].unsqueeze(1))
                 for t in self.layer_rope}  # one gather per table, not per layer
        layers, linear = self._matmuls(n)
        x = self._embed(input_ids) * self.embed_scale
        for i, lw in enumerate(layers):
            h = _rms_norm(x, lw.input_norm, eps)
            qkv = linear(h, lw.qkv, lw.qkv_bias)
            q = qkv[:, :nq].view(n, c.num_heads, hd)
            k = qkv[:, nq:nq + nkv].view(n, c.num_kv_heads, hd)
            v = qkv[:, nq + nkv:].view(n, c.num_kv_heads, hd)
            if lw.q_norm is not None:  # Gemma 3: RMSNorm of each head before RoPE
                q, k = _rms_norm(q, lw.q_norm, eps), _rms_norm(k, lw.k_norm, eps)
            cos, sin = ropes[id(self.layer_rope[i])]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            write_kv(k.contiguous(), v, kv_caches[i], meta.slot_mapping)
            attn = attention(q.contiguous(), kv_caches[i], meta, self.scale, self.windows[i],
                             self.attn_softcap)
            o = self._reduce(linear(attn.reshape(n, nq), lw.o_proj, lw.o_bias))
            x = x + _rms_norm(o, lw.post_norm, eps)
            h = _rms_norm(x, lw.pre_ffn_norm, eps)
            gate_up = linear(h, lw.gate_up, lw.gate_up_bias)
            act = F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
            d = self._reduce(linear(act, lw.down, lw.down_bias))
            x = x + _rms_norm(d, lw.post_ffn_norm, eps)
        x = _rms_norm(x[logits_indices], w.final_norm, eps)
        logits = self._logits(x, argmax_only)
        if logits is not None and self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
