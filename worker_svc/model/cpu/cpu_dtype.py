"""CPU matmul weights: prepacked in oneDNN's layout, and bfloat16 as matmul weights only.

A decode step on CPU streams every weight once per step. oneDNN can hold a weight in
its own blocked layout, packed once at load instead of on every call; measured on an
AVX512_BF16 EPYC, one thread: the 49152 x 576 vocabulary projection of 64 tokens took
44 ms prepacked against 74 ms through F.linear in fp32, and of one token in bf16
3.8 against 7.1 ms. --no-cpu-prepack keeps plain tensors and F.linear.

--dtype bfloat16 on CPU: halving the weights' bytes halves what bounds a small batch,
and bf16 dot-product instructions (AVX512_BF16, AMX) do twice the multiply-adds of
fp32 for a large batch. The residual stream, norms, RoPE, attention and the KV cache
stay fp32: the fp32 C ops and the decode attention kernel keep working, and only
the matmuls round (their inputs to bf16, accumulating in fp32), which keeps greedy
output closer to the fp32 reference than a whole-bf16 model (docs/benchmarks.md).

One copy of each matmul weight where the small-batch kernel reads plain ones: its
row-major copy serves the wide steps too, through oneDNN on the plain layout
(onednn_linear: oneDNN lays the weight out as it goes), instead of a prepacked copy
beside it. The second copy was 538 MB of the default model's 1.1 GB of weights, the
difference between a full KV pool fitting a 2 GB stack or not (docs/tuning.md,
"Memory"); benchmarks/small_linear.py on the Sapphire Rapids VM, one thread, CPU ms
for all the model's matmuls, oneDNN on the plain weight against the packed one:
16 rows 100.5 against 86.9, 64: 188.3/167.5, 256: 472.9/456.0 (F.linear: 119.5,
202.6, 477.8). Steps of up to small_linear.MAX_ROWS rows, every decode step of up
to 8 streams, do not change. The prepacked copy stays where it is the wide steps'
only fp32 copy: --no-cpu-small-batch, and --quantization int8 (whose copies are int8).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from worker_svc.model.cpu import small_linear
from worker_svc.model.loading.weights import ModelWeights

# The batch oneDNN packs each weight for (_reorder_linear_weight's batch_size). Packed
# for one row, every call of more rows first copies the weight into the layout it wants
# (brgemm's copy_b_chunk_in_buffer: 18% of a 64-decode step); steps of up to
# small_linear.MAX_ROWS rows go to the small-batch kernel anyway. Measured on the Zen 3
# EPYC, 2 threads, the model's matmuls (benchmarks/small_linear.py shapes): packed for
# 16 rows against 1, at 5 rows 49.8 against 67.8 ms, 8: 58.0/84.2, 16: 68.9/88.4,
# 32: 107/131, 64: 172/203, 128: 270/329, 512: equal; and 1 row 43.2/46.3.
PACK_BATCH = 16
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


def prepack_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a weight of this dtype here (the compute plan asks)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16() is not None)


def prepare_matmul_weights(weights: ModelWeights, dtype: torch.dtype, pack: bool,
                           small: str | None = None) -> ModelWeights:
    """The same weights with every matmul weight (and the vocabulary projection) in
    dtype and, with pack (the compute plan's prepack) and no plain small-batch copies,
    prepacked; norms and the embedding table stay plain tensors (the embedding looks
    rows up; a tied projection gets its own packed copy).
    Each original is dropped as it is replaced, so the peak is one tensor over.
    small: the small-batch kernel's weights: "plain" row-major weights in dtype, the
    one copy every step reads (never prepacked: see the module's docstring; wide steps
    run onednn_linear on them where pack asks for oneDNN), "int8" int8 copies
    quantized from the loaded weights (small_linear.Int8Weight, --quantization int8)
    beside the dtype ones (ModelWeights.plain_layers, plain_lm_head), None none."""
    int8 = small == "int8"
    pack = pack and small != "plain"
    if not pack and not int8 and dtype == weights.embed.dtype:
        return weights
    layers, small_layers = [], []
    for lw in weights.layers:
        if int8:  # from the loaded (fp32) weights, before any rounding to dtype
            small_layers.append(dataclasses.replace(lw, **{
                name: small_linear.quantize_int8(getattr(lw, name))
                for name in LINEARS if not name.endswith("bias")}))
        layers.append(dataclasses.replace(lw, **{
            name: _prepare(getattr(lw, name), dtype, pack and not name.endswith("bias"))
            for name in LINEARS}))
    weights.layers = layers  # release the originals before the vocabulary copies
    tied = weights.lm_head is weights.embed
    small_lm_head = small_linear.quantize_int8(weights.lm_head) if int8 else None
    embed = weights.embed.to(dtype)
    plain_lm_head = embed if tied else weights.lm_head.to(dtype).contiguous()
    lm_head = _prepare(plain_lm_head, dtype, True) if pack else plain_lm_head
    return ModelWeights(embed=embed, layers=layers, final_norm=weights.final_norm,
                        lm_head=lm_head, plain_layers=small_layers or None,
                        plain_lm_head=small_lm_head)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias through oneDNN on a plain row-major weight (in the
    activation's dtype out): the wide steps of a worker whose one copy of the weights
    is the small-batch kernel's."""
    return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none",
                                              [], "").to(x.dtype)


def _prepare(t: torch.Tensor | None, dtype: torch.dtype, pack: bool) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.to(dtype).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(t, PACK_BATCH) if pack else t
