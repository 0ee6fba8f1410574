"""bfloat16 on CPU: the matmul weights in bf16, everything else in fp32.

A decode step on CPU streams every weight once per step, so halving the weights'
bytes halves what bounds a small batch, and oneDNN's bf16 kernels (AVX512_BF16, AMX
where present) do twice the multiply-adds of fp32 ones for a large batch. The
residual stream, norms, RoPE, attention and the KV cache stay fp32: the fp32 C ops
and the decode attention kernel keep working, and only the matmuls round (their
inputs to bf16, accumulating in fp32), which keeps greedy output closer to the fp32
reference than a whole-bf16 model (docs/benchmarks.md measures the agreement).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from worker_svc.model.weights import LayerWeights, ModelWeights

LINEARS = ("qkv", "qkv_bias", "o_proj", "o_bias", "gate_up", "gate_up_bias", "down",
           "down_bias")


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> str | None:
    """Which bf16 matmul instructions this CPU has (amx_bf16, avx512_bf16), or None:
    without them oneDNN emulates bf16 and it is slower than fp32."""
    flags = cpu_flags()
    for name in ("amx_bf16", "avx512_bf16"):
        if name in flags:
            return name
    return None


def cast_matmul_weights(weights: ModelWeights, dtype: torch.dtype) -> ModelWeights:
    """The same weights with every matmul weight (and the tied or separate vocabulary
    projection and the embedding it shares) in dtype; norms stay as they are. The
    fp32 originals are dropped as each is replaced, so the peak is one tensor over."""
    pack = prepack_available(dtype)
    layers = []
    for lw in weights.layers:
        cast = {name: _cast(getattr(lw, name), dtype, pack and not name.endswith("bias"))
                for name in LINEARS}
        layers.append(dataclasses.replace(lw, **cast))
    weights.layers = layers  # release the fp32 layers before the vocabulary copy
    embed = weights.embed.to(dtype)  # a plain tensor: the embedding looks rows up
    lm_head = _cast(weights.lm_head, dtype, pack) if pack else \
        (embed if weights.lm_head is weights.embed else weights.lm_head.to(dtype))
    return ModelWeights(embed=embed, layers=layers, final_norm=weights.final_norm,
                        lm_head=lm_head)


def prepack_available(dtype: torch.dtype) -> bool:
    """oneDNN can hold a bf16 weight in its own blocked layout (done once here rather
    than on every call): measured on an AVX512_BF16 EPYC, one thread, the 49152 x 576
    vocabulary projection of one token took 3.8 ms prepacked against 7.1 ms through
    F.linear, and the 3072 x 576 MLP projection of 64 tokens 1.18 against 1.47 ms."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and native_bf16() is not None
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _cast(t: torch.Tensor | None, dtype: torch.dtype, pack: bool) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.to(dtype).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(t, 1) if pack else t
