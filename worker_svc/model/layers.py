"""The pieces every model family is built from, one definition each: the matmul, the
RMSNorm variants, the rotary tables and their application, the paged attention call,
the gated MLPs, the vocabulary-parallel embedding and logits, the mixture-of-experts
layer. Plain functions over tensors (no nn.Modules): llama.py's fast path and the
torch families (torch_decoder.py and the family modules) call the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.model.cpu import quant_weights
from worker_svc.model.cpu.quant_weights import QuantWeight


# ---------------------------------------------------------------- matmul and norms

def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, or oneDNN's on a weight prepacked by cpu_dtype; with bf16 weights under
    fp32 activations the input is rounded to bf16 and the output widened back; a GGUF's
    blocks (QuantWeight) through the quantized kernel, for any number of rows."""
    if isinstance(weight, QuantWeight):
        return quant_weights.load()(x, weight, bias)
    if weight.is_mkldnn:  # prepacked by cpu_dtype: oneDNN's own layout
        return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none",
                                                  [], "").to(x.dtype)
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (x / rms(x) * w) over the last dimension."""
    if x.dtype == torch.float32:  # the fused kernel; same result as the reference's steps
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()  # half precision: normalize in fp32, then scale, like the reference
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_one_plus(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scaled by (1 + w), in fp32 before the cast back. fp32 through
    the fused kernel (x / rms(x) * (1 + w), the reference's steps in its order: the
    same bits, tests/families/test_families_match_transformers.py), at half the cost of the steps one by
    one (a Gemma 3 270M token runs 109 of these)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, 1.0 + weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


# ---------------------------------------------------------------- rotary embeddings

def rope_tables(inv_freq: torch.Tensor, scaling: float, head_dim: int, max_positions: int,
                device, dtype, long_inv_freq: torch.Tensor | None = None,
                long_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, 2 * len(inv_freq)] of the rotate-half RoPE (head_dim
    wide, or the rotary part of a head under partial rotary), computed in fp32 like the
    reference and cast once; rotate_half(x) == roll(x, half) * [-1.., +1..], so that
    sign is folded into sin and apply_rope is two multiplies and a roll. Positions from
    long_from on rotate with long_inv_freq (longrope, model/phi3.py)."""
    positions = torch.arange(max_positions, dtype=torch.float).unsqueeze(1)
    freqs = positions * inv_freq
    if long_inv_freq is not None and long_from < max_positions:
        freqs[long_from:] = positions[long_from:] * long_inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    half = inv_freq.shape[0]
    sign = torch.cat((-torch.ones(half), torch.ones(half)))
    cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
    sin = (emb.sin() * scaling * sign).to(device=device, dtype=dtype)
    return cos, sin


def longrope_rows(positions: torch.Tensor, num_prompt_tokens: list[int], q_lens: list[int],
                  long_from: int, max_positions: int) -> torch.Tensor:
    """The rope-table rows of a step's tokens under longrope (model/phi3.py): a request
    whose prompt is longer than long_from (original_max_position_embeddings) rotates
    every token with the long factors, from the second table at max_positions on, as
    transformers' one-call prefill of that prompt does; the others keep the per-position
    table (long from long_from on, as transformers' decode calls past it)."""
    offsets = [max_positions if n > long_from else 0 for n in num_prompt_tokens]
    if not any(offsets):
        return positions
    return positions + torch.repeat_interleave(
        torch.tensor(offsets, device=positions.device),
        torch.tensor(q_lens, device=positions.device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim]; cos/sin [tokens, 1, rotary_dim] (rope_tables' rows of
    the tokens' positions): the first rotary_dim dims rotated, the rest passed through
    (partial rotary, Phi-4-mini)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(rotary_dim // 2, dims=-1), sin)
    rot = x[..., :rotary_dim]
    rot = torch.addcmul(rot * cos, rot.roll(rotary_dim // 2, dims=-1), sin)
    return torch.cat((rot, x[..., rotary_dim:]), dim=-1)


# ---------------------------------------------------------------- attention

def paged_attention(backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, meta, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Write this step's k/v into the paged cache, then attend q over each request's
    cached tokens (the backend the compute plan chose). q [tokens, heads, head_dim];
    window: the layer's sliding window (config.layer_windows), None: every key;
    softcap: scores capped at +-softcap by tanh (Gemma 2)."""
    backend.write_kv(k, v, kv_cache, meta.slot_mapping)
    if window is None and softcap is None:
        return backend.attention(q, kv_cache, meta, scale)
    return backend.attention(q, kv_cache, meta, scale, window, softcap)


# ---------------------------------------------------------------- gated MLPs

def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on [gate; up] fused along the last dimension."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (tanh approximation, Gemma's gelu_pytorch_tanh) on [gate; up]."""
    half = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :half], approximate="tanh") * gate_up[..., half:]


ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              act=silu_and_mul) -> torch.Tensor:
    """down(act(gate) * up) with [gate; up] in one matmul; a row-parallel partial sum
    under tensor parallelism (the caller reduces)."""
    return linear(act(linear(x, gate_up)), down)


# ---------------------------------------------------------------- vocabulary

def vocab_parallel_embed(input_ids: torch.Tensor, table: torch.Tensor, dtype, tp
                         ) -> torch.Tensor:
    """Embeddings in the activation dtype; under tensor parallelism each rank looks up
    the ids in its rows (tp.plan.vocab), zeros elsewhere, and the sum over ranks is
    exact (one nonzero term per element). A GGUF's blocks: their rows widened by id."""
    if isinstance(table, QuantWeight):  # held on one rank only (gguf_quantized.py)
        return quant_weights.load().gather(table, input_ids).to(dtype)
    if tp is None:
        return F.embedding(input_ids, table).to(dtype)
    start, stop = tp.plan.vocab
    mine = (input_ids >= start) & (input_ids < stop)
    x = F.embedding((input_ids - start) * mine, table).to(dtype)
    x *= mine.unsqueeze(1).to(x.dtype)
    return tp.all_reduce(x)


def gathered_logits(logits: torch.Tensor, tp, vocab_size: int) -> torch.Tensor | None:
    """fp32 [rows, vocab]: with tensor parallelism each rank computed its vocab columns
    and rank 0 gets them all (None on the other ranks)."""
    if tp is None:
        return logits.float()
    if logits.shape[0] == 0:  # every rank agrees: no row samples this step
        return logits.float() if tp.rank == 0 else None
    full = tp.gather_to_first(logits, vocab_size)
    return None if full is None else full.float()


# ---------------------------------------------------------------- mixture of experts

@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A top-k mixture-of-experts layer as its family defines the router."""
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k probabilities rescaled to sum to 1 (Mixtral always;
    # Qwen3-MoE when norm_topk_prob)
    # Qwen2-MoE: a shared expert of this width every token passes, scaled by
    # sigmoid(its gate) and added (0: none)
    shared_intermediate_size: int = 0


@dataclass(slots=True)
class MoeWeights:
    """One MoE layer as a rank holds it: the whole router, and its experts
    [first, first + len) whole (experts are split across tensor-parallel ranks)."""
    router: torch.Tensor  # [num_experts, hidden]
    # [local experts, 2 * intermediate, hidden]: [gate; up] rows (a GGUF's blocks: a
    # list of one QuantWeight per expert, indexed alike)
    gate_up: torch.Tensor | list[QuantWeight]
    down: torch.Tensor | list[QuantWeight]  # [local experts, hidden, intermediate]
    first: int  # the global id of this rank's first expert
    # the shared expert ([gate; up], down, gate [1, hidden]), held whole by the rank
    # with expert 0 (a partial sum like the rest); None without one or on other ranks
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None


def route(router_logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] fp32, expert ids [tokens, top_k]): softmax in fp32 over
    every expert, then the top k, renormalised where the family does (Mixtral's and
    Qwen3-MoE's router, in transformers' order of operations)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe(x: torch.Tensor, w: MoeWeights, spec: MoeSpec, act=silu_and_mul,
        tally: list[int] | None = None) -> torch.Tensor:
    """The layer's output for x [tokens, hidden]: each token through its top-k experts,
    weighted. Only the routed experts run, each once on the rows routed to it (tokens
    grouped by expert, never a dense all-experts pass); a rank runs only the experts it
    holds, so under tensor parallelism the result is a partial sum (the caller reduces).
    tally: per-expert running counts of routed tokens, added to (the load metric)."""
    weights, ids = route(linear(x, w.router), spec)
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=spec.num_experts).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    for local in range(len(w.gate_up)):
        e = w.first + local
        if counts[e] == 0:
            continue
        if tally is not None:
            tally[e] += counts[e]
        pairs = order[starts[e]:starts[e + 1]]
        rows = pairs // spec.top_k
        y = linear(act(linear(x[rows], w.gate_up[local])), w.down[local])
        y = y * weights.flatten()[pairs].unsqueeze(1).to(y.dtype)
        out.index_add_(0, rows, y)
    if w.shared_gate_up is not None:  # Qwen2-MoE, in transformers' order
        shared = linear(act(linear(x, w.shared_gate_up)), w.shared_down)
        out = out + torch.sigmoid(linear(x, w.shared_gate)) * shared
    return out
