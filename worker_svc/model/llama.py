"""The llama family (Llama, Mistral, SmolLM, Qwen2): its config rules and the fast
path's decoder forward, the only one the C kernels run (registry.py).

One call runs every scheduled token of a step (prefill chunks and decodes of many
requests, flattened into one [num_tokens] batch, no padding). Layers are plain
loops over fused weights, not nn.Modules: on a 2-core CPU the per-op Python cost
of a 30-layer model is a visible share of a decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.kv_capacity import kv_cache_tensors
from worker_svc.model.cpu import cpu_dtype, decode_layers, fused_ops, quant_weights, small_linear
from worker_svc.model.cpu.quant_weights import QuantWeight
from worker_svc.model import layers
from worker_svc.model.config import ModelConfig, layer_windows, require_silu
from worker_svc.model.loading.weights import (CheckpointSlices, ModelWeights,
                                              load_weights as _load_weights)

# model_type -> whether q/k/v projections carry a bias regardless of config flags
QKV_BIAS = {"llama": False, "mistral": False, "qwen2": True}


def configure(hf, cfg: ModelConfig) -> ModelConfig:
    """The family's own fields: Qwen2's q/k/v bias, Mistral's sliding window."""
    require_silu(hf)
    cfg.qkv_bias = QKV_BIAS[hf.model_type] or bool(getattr(hf, "attention_bias", False))
    if hf.model_type == "mistral" and getattr(hf, "sliding_window", None):
        cfg.sliding_window = int(hf.sliding_window)
    if hf.model_type == "qwen2" and getattr(hf, "use_sliding_window", False):
        raise ValueError("Qwen2 sliding-window attention is not supported")
    return cfg


def load_weights(model_dir, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 shard=None, matmul_dtype: torch.dtype | None = None,
                 slices=CheckpointSlices) -> ModelWeights:
    """In the activation dtype; the runner's cpu_dtype.prepare_matmul_weights makes the
    matmul copies (bf16, prepacked, int8) the compute plan asks for. slices: how the
    checkpoint is read (gguf_quantized.QuantizedSlices: a GGUF's blocks kept)."""
    return _load_weights(model_dir, cfg, dtype, device, shard, slices)


class DecoderModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, backend,
                 max_positions: int, plan, tp=None) -> None:
        """cfg: the model as this rank holds it (ShardPlan.local_config); plan: the
        worker's ComputePlan (worker_svc/compute_plan.py), which every step follows;
        tp: the tensor-parallel group (worker_svc.parallel.group), None when unsplit."""
        self.cfg = cfg
        self.w = weights
        self.backend = backend  # module with write_kv() and attention()
        self.tp = tp
        if tp is not None:
            self._reduce = tp.all_reduce  # the row-parallel partial sums
            self.vocab = tp.plan.vocab  # rows of embed and lm_head this rank holds
        else:
            self._reduce = _unchanged
        self.scale = cfg.head_dim ** -0.5
        # each layer's sliding window, None where it attends to every key
        self.windows = layer_windows(cfg, max_positions)
        if plan.decode_layers and any(self.windows):
            raise RuntimeError("the compute plan's C layer loop has no sliding window")
        # activations and KV cache; bf16 matmul weights on CPU keep them fp32 (cpu_dtype)
        device, dtype = weights.embed.device, plan.act_dtype
        self.dtype = dtype
        # cos/sin per position (sin carries rotate_half's sign: layers.rope_tables)
        self.cos, self.sin = layers.rope_tables(cfg.inv_freq, cfg.rope_scaling, cfg.head_dim,
                                                max_positions, device, dtype)
        # fp32 on CPU: a layer's element-wise ops in C (fused_ops)
        self.fused = fused_ops.load() if plan.fused_ops else None
        # steps of few tokens: the small-batch kernel on its copies (small_linear)
        self.small = small_linear.load() if plan.small_batch != "off" else None
        self._small_layers = weights.plain_layers or weights.layers
        self._small_lm_head = weights.plain_lm_head if weights.plain_lm_head is not None \
            else weights.lm_head
        plain = [self._small_lm_head] + [getattr(lw, n) for lw in self._small_layers
                                         for n in ("qkv", "o_proj", "gate_up", "down")]
        if self.small is not None and not all(small_linear.supports(t) for t in plain):
            raise RuntimeError(f"the compute plan's small-batch kernel ({plan.small_batch}) "
                               "cannot read these weights")
        # steps up to this many tokens run the kernel (more on int8 copies); the
        # vocabulary projection's own limit is the plan's too
        self.small_max_rows = plan.small_max_rows
        # wider steps: oneDNN (prepacked weights, or the small-batch kernel's plain ones,
        # the one copy then: cpu_dtype), else torch's matmul
        self._wide_linear = cpu_dtype.onednn_linear if (
            plan.prepack and plan.small_batch == "plain") else _linear
        self.logits_max_rows = plan.logits_max_rows
        # greedy rows of small steps: the projection screened by an int8 copy
        self.argmax_screen = weights.argmax_screen if plan.argmax_screen else None
        # small decode steps: every layer in one C call, the same kernels (decode_layers)
        self.decode_layers = None
        if plan.decode_layers:
            self.decode_layers = decode_layers.DecodeLayers.build(cfg, self._small_layers, tp)
            if self.decode_layers is None:
                raise RuntimeError("the compute plan's C layer loop cannot take this model")
        self.screen_rows = {"screened": 0, "full": 0}  # the worker's metrics read these

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        c = self.cfg
        return kv_cache_tensors(c.num_layers, (2, num_blocks, block_size, c.num_kv_heads,
                                               c.head_dim), self.dtype, self.w.embed.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                logits_indices: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] of the rows that sample. argmax_only:
        the caller takes only each row's argmax, so other logits may be -inf."""
        if self.fused is not None and fused_ops.takes(input_ids, positions, meta.slot_mapping):
            return self._forward_fused(input_ids, positions, kv_caches, meta, logits_indices,
                                       argmax_only)
        c, w = self.cfg, self.w
        n = input_ids.shape[0]
        nq, nkv, hd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        num_heads, half = c.num_heads, hd // 2
        cos = self.cos[positions].unsqueeze(1)  # [n, 1, head_dim], shared by all layers
        sin = self.sin[positions].unsqueeze(1)
        eps = c.rms_norm_eps
        write_kv, attention = self.backend.write_kv, self.backend.attention

        layers, linear = self._matmuls(n)
        x = self._embed(input_ids)
        residual = x
        for i, lw in enumerate(layers):
            h = _rms_norm(x, lw.input_norm, eps)
            qkv = linear(h, lw.qkv, lw.qkv_bias)
            # RoPE on the q and k heads together: one pass instead of two
            qk = qkv[:, :nq + nkv].view(n, -1, hd)
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
            q, k = qk[:, :num_heads], qk[:, num_heads:]
            v = qkv[:, nq + nkv:].view(n, c.num_kv_heads, hd)
            write_kv(k, v, kv_caches[i], meta.slot_mapping)
            attn = attention(q, kv_caches[i], meta, self.scale, self.windows[i])
            x = residual + self._reduce(linear(attn.reshape(n, nq), lw.o_proj, lw.o_bias))
            residual = x
            h = _rms_norm(x, lw.post_norm, eps)
            gate_up = linear(h, lw.gate_up, lw.gate_up_bias)
            x = residual + self._reduce(linear(F.silu(gate_up[:, :c.intermediate_size])
                                               * gate_up[:, c.intermediate_size:],
                                               lw.down, lw.down_bias))
            residual = x
        # only the rows that sample need the norm and the (large) vocabulary projection
        x = _rms_norm(x[logits_indices], w.final_norm, eps)
        return self._logits(x, argmax_only)


    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                       logits_indices: torch.Tensor, argmax_only: bool = False
                       ) -> torch.Tensor:
        """forward() with the norms, RoPE, KV write and residual adds in C (fused_ops):
        the same math, rounded the same way (SiLU's exp within a few ulp), in four
        torch matmuls and four C calls a layer instead of about twenty torch ops."""
        c, w, ops = self.cfg, self.w, self.fused
        n = input_ids.shape[0]
        nq, hd, eps = c.num_heads * c.head_dim, c.head_dim, c.rms_norm_eps
        attention = self.backend.attention
        layers, linear = self._matmuls(n)
        residual = self._embed(input_ids)  # a fresh tensor: updated in place
        plan = None
        # the C decode kernel's plan for this step, if this backend has one
        decode_plan = getattr(self.backend, "decode_kernel_plan", None)
        if self.decode_layers is not None and decode_plan and n <= self.small_max_rows:
            plan = decode_plan(meta, c.num_heads, kv_caches[0], self.scale)
        if plan is not None:  # the loop below, in one C call
            residual += self.decode_layers.run(residual, positions, meta.slot_mapping,
                                               kv_caches, plan, self.cos, self.sin)
            x = ops.rms_norm(residual[logits_indices], w.final_norm, eps)
            return self._logits(x, argmax_only)
        delta = None  # what the last sublayer adds to the residual stream
        for i, lw in enumerate(layers):
            h = ops.rms_norm(residual, lw.input_norm, eps) if delta is None \
                else ops.add_rms_norm(residual, delta, lw.input_norm, eps)
            qkv = linear(h, lw.qkv, lw.qkv_bias)
            ops.rope_write_kv(qkv, c.num_heads, c.num_kv_heads, hd, self.cos, self.sin,
                              positions, kv_caches[i], meta.slot_mapping)
            attn = attention(qkv[:, :nq].view(n, c.num_heads, hd), kv_caches[i], meta,
                             self.scale, self.windows[i])
            o = self._reduce(linear(attn.reshape(n, nq), lw.o_proj, lw.o_bias))
            h = ops.add_rms_norm(residual, o, lw.post_norm, eps)
            gate_up = linear(h, lw.gate_up, lw.gate_up_bias)
            delta = self._reduce(linear(ops.silu_mul(gate_up), lw.down, lw.down_bias))
        residual += delta
        # only the rows that sample need the norm and the (large) vocabulary projection
        x = ops.rms_norm(residual[logits_indices], w.final_norm, eps)
        return self._logits(x, argmax_only)

    def _matmuls(self, rows: int):
        """The layers' weights and the matmul for a step of `rows` tokens: the
        small-batch kernel on its copies up to small_max_rows, else oneDNN/torch."""
        if self.small is not None and rows <= self.small_max_rows:
            return self._small_layers, self.small
        return self.w.layers, self._wide_linear

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings in the activation dtype (fp32 under bf16 CPU weights)."""
        if isinstance(self.w.embed, QuantWeight):  # a GGUF's blocks: rows widened
            return quant_weights.load().gather(self.w.embed, input_ids)
        return layers.vocab_parallel_embed(input_ids, self.w.embed, self.dtype, self.tp)

    def _logits(self, x: torch.Tensor, argmax_only: bool = False) -> torch.Tensor | None:
        """[rows, vocab] fp32 logits; with tensor parallelism each rank computes its
        vocab columns and rank 0 gets them all (None on the other ranks). argmax_only:
        rows of a small step may come back screened (-inf where the argmax is not)."""
        small = self.small is not None and 0 < x.shape[0] <= self.logits_max_rows
        if argmax_only and small and self.argmax_screen is not None:
            logits = small_linear.screened_argmax_logits(self.small, x, self.argmax_screen,
                                                         self._small_lm_head)
            self.screen_rows["full" if logits is None else "screened"] += x.shape[0]
            if logits is not None:
                return logits
        if small:
            logits = self.small(x, self._small_lm_head)
        else:
            logits = self._wide_linear(x, self.w.lm_head)
        return layers.gathered_logits(logits, self.tp, self.cfg.vocab_size)


def _unchanged(t: torch.Tensor) -> torch.Tensor:
    return t


_linear = layers.linear
_rms_norm = layers.rms_norm
Model = DecoderModel  # the family's model (registry.py)
