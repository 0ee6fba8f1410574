"""The quantized-weight kernel (csrc/quant_linear.c) against the `gguf` package: each
GGUF type's blocks widened bit for bit as gguf.quants.dequantize widens them, and the
matmul equal to dequantize-then-matmul within what the order of fp32 sums allows, on
every ISA build this CPU runs (an AVX-512 machine also runs the AVX2 code and the
portable loop of the baseline build, which AVX2-only and older CPUs get)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from worker_svc import native
from worker_svc.model.cpu import quant_weights
from worker_svc.model.cpu.quant_weights import QuantWeight, concat

pytestmark = pytest.mark.skipif(quant_weights.load() is None, reason="no C compiler")


@pytest.fixture(params=[v.name for v in native.supported_variants()])
def kernel(request) -> quant_weights.QuantLinear:
    """quant_linear built for one ISA level (native.py's variants), whatever the best."""
    variant = next(v for v in native.supported_variants() if v.name == request.param)
    path = native.compile_variant("quant_linear", variant, quant_weights.FLAGS)
    assert path is not None
    return quant_weights.QuantLinear(ctypes.CDLL(str(path)))

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# byte offsets of each K block's fp16 scales: the rest of the block may be random bits
_K_SCALES = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, row bytes] uint8 blocks of `kind`: gguf.quants.quantize of random values,
    or (K-quants, which it does not write) random bits with small finite scales."""
    rng = np.random.default_rng(seed)
    if kind in K_TYPES:
        size, at = _K_SCALES[kind]
        raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
        for a in at:
            s = rng.uniform(0.001, 0.01, size=(rows, cols // 256)).astype(np.float16)
            raw[:, :, a:a + 2] = s.view(np.uint8).reshape(rows, cols // 256, 2)
        return raw.reshape(rows, -1)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    if kind == "F32":
        return w.view(np.uint8)
    if kind == "F16":
        return w.astype(np.float16).view(np.uint8)
    return quantize(w, T[kind])


def weight(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[QuantWeight, np.ndarray]:
    raw = blocks(kind, rows, cols, seed)
    ref = np.asarray(dequantize(raw, T[kind]), dtype=np.float32).reshape(rows, cols)
    return QuantWeight(((kind, torch.from_numpy(np.ascontiguousarray(raw))),), cols), ref


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|fp32 sum in any order - exact| <= n u sum|x w| (+ a little)"""
    n = x.shape[1]
    return (x.double().abs() @ w.double().abs().T) * (n * 2.0 ** -24) + 1e-30


ALL = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("kind", ALL)
def test_rows_widen_to_gguf_dequantize_bit_for_bit(kernel, kind):
    w, ref = weight(kind, 37, 512)
    got = kernel.gather(w, torch.arange(37)).numpy()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 33])
def test_matmul_is_dequantize_then_matmul_up_to_sum_order(kernel, kind, rows):
    w, ref = weight(kind, 70, 768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    got = kernel(x, w).double()
    exact = x.double() @ torch.from_numpy(ref).double().T
    assert got.shape == (rows, 70)
    assert bool(((got - exact).abs() <= bound(x, torch.from_numpy(ref))).all())


@pytest.mark.parametrize("kind", ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                  "Q6_K"))
def test_a_token_rows_output_bits_do_not_depend_on_the_rows_beside_it(kernel, kind):
    """A lone stream's pass (1-2 rows, weight rows taken 8 at a time), the few-row
    pass and the wide tiles sum each output in one order: a request's logits do not
    change with the batch it shares a step with. 70 weight rows: groups of 8 and a
    tail; a second segment of another type: groups that straddle it."""
    w = concat([weight(kind, 70, 512, seed=1)[0], weight("Q8_0", 13, 512, seed=2)[0]])
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([kernel(x[r:r + 1], w) for r in range(4)])
    for rows in (2, 3, 8, 9, 40):
        got = kernel(x[:rows], w)[:4]
        assert torch.equal(got[:min(rows, 4)].view(torch.int32),
                           alone[:min(rows, 4)].view(torch.int32)), rows


def test_strided_rows_and_bias(kernel):
    w, ref = weight("Q4_1", 16, 256)
    big = torch.randn(4, 300)
    x = big[:, 10:266]  # a row stride that is not the width
    bias = torch.randn(16)
    got = kernel(x, w, bias).double()
    exact = x.double() @ torch.from_numpy(ref).double().T + bias.double()
    assert bool(((got - exact).abs() <= bound(x, torch.from_numpy(ref)) + 1e-6).all())


def test_fused_parts_of_different_types_keep_their_rows(kernel):
    """[q; k; v] of a Q4_K_M file: parts of different types, rows in order."""
    parts = [weight(k, r, 512, seed=i) for i, (k, r) in
             enumerate([("Q5_0", 24), ("Q5_0", 8), ("Q8_0", 8), ("Q6_K", 5)])]
    fused = concat([p for p, _ in parts])
    assert fused.types == ("Q5_0", "Q8_0", "Q6_K")  # adjacent Q5_0 parts joined
    ref = np.concatenate([r for _, r in parts])
    x = torch.randn(3, 512)
    got = kernel(x, fused).double()
    exact = x.double() @ torch.from_numpy(ref).double().T
    assert bool(((got - exact).abs() <= bound(x, torch.from_numpy(ref))).all())


def test_gather_rows_is_an_embedding_lookup_and_refuses_bad_ids():
    w, ref = weight("Q8_0", 50, 256)
    ids = torch.tensor([3, 0, 49, 3])
    assert np.array_equal(quant_weights.load().gather(w, ids).numpy(), ref[[3, 0, 49, 3]])
    with pytest.raises(IndexError):
        quant_weights.load().gather(w, torch.tensor([50]))


def test_a_row_of_partial_blocks_is_refused():
    with pytest.raises(ValueError, match="whole blocks"):
        QuantWeight((("Q4_0", torch.zeros(2, 18, dtype=torch.uint8)),), 40)
