"""The int8-activation path (--quant-activations int8): weights repacked at load
(quant_weights.pack, csrc/quant_packed.h), activations quantized per 32 values, block
dots summed in integers.

What holds it: the SIMD loop (AVX512-VNNI) gives the portable loop's bits for every
type, shape and batch; the portable loop is x's int8 rounding (amax / 127 a block)
times the file's dequantized weights up to float rounding; a row's output does not
depend on the rows beside it; a NaN stays in its row; segments the repacking does not
take (Q6_K, F32) keep the exact path inside the same weight; a repacked descriptor
for a type the kernel cannot read is refused."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from worker_svc import native
from tests.worker.test_quant_linear import weight
from worker_svc.model.cpu import quant_weights
from worker_svc.model.cpu.quant_weights import PACKS, QuantWeight, concat, pack

LIB = quant_weights.load()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler")
TYPES = sorted(PACKS)


@pytest.fixture(params=[v.name for v in native.supported_variants()], scope="module")
def built(request) -> quant_weights.QuantLinear:
    """quant_linear built for one ISA level this CPU runs: its int8 loop (AVX512-VNNI,
    AVX2, or the portable one of the baseline build) against the portable reference."""
    variant = next(v for v in native.supported_variants() if v.name == request.param)
    return quant_weights.QuantLinear(ctypes.CDLL(str(
        native.compile_variant("quant_linear", variant, quant_weights.FLAGS))))


def x_int8(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it: per 32 values, scale amax / 127, rint(x * 127 / amax),
    in float64 (the reference's input)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # fp32, as the C
    q = torch.round(blocks * inv)  # rint: ties to even, as torch.round
    d = amax / 127.0
    return (q.double() * d.double()).reshape(x.shape)


def reference(x: torch.Tensor, w_ref: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x_int8 @ W.T and the scale its float rounding is measured against."""
    xq, w = x_int8(x), torch.from_numpy(w_ref).double()
    return xq @ w.T, xq.abs() @ w.abs().T


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 64])
def test_portable_loop_is_int8_x_times_the_dequantized_weight(kind, rows):
    w, w_ref = weight(kind, 70, 768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    got = LIB(x, pack(w), portable=True).double()
    want, scale = reference(x, w_ref)
    # the integer block sums are exact; float rounding of a few terms a block (the min
    # term cancels against the values' own: at most ~256x a value's size) stays far
    # below this, and a wrong row, block or scale is of the order of `scale` itself
    assert bool(((got - want).abs() <= 1e-4 * scale + 1e-30).all())


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("shape", [(70, 768), (17, 256), (1, 512), (48, 1536)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_builds_loop_gives_the_portable_bits(built, kind, shape):
    out, inp = shape
    w = pack(weight(kind, out, inp, seed=out)[0])
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 11, 33):
        x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
        got, want = built(x, w), LIB(x, w, portable=True)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (rows, kind)


def test_each_build_runs_its_own_loop():
    """The tests above compare real SIMD loops where this CPU has them."""
    loops = {v.name: quant_weights.QuantLinear(ctypes.CDLL(str(native.compile_variant(
        "quant_linear", v, quant_weights.FLAGS)))).packed_loop
        for v in native.supported_variants()}
    assert loops.get("x86-64-v2", "portable") == "portable"
    if "avx2" in loops:
        assert loops["avx2"] == "avx2"
    if "avx512" in loops:
        assert loops["avx512"] in ("avx2", "avx512_vnni")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_a_row_is_the_same_alone_or_in_any_batch(kind):
    w = pack(weight(kind, 100, 1536)[0])
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(7))
    together = LIB(x, w)
    for lo, hi in ((0, 1), (5, 6), (3, 11), (40, 64)):
        assert torch.equal(LIB(x[lo:hi], w), together[lo:hi])
    strided = torch.randn(64, 2000)[:, :1536]
    strided.copy_(x)
    assert torch.equal(LIB(strided, w), together)  # x's row stride is read, not assumed


def test_a_nan_stays_in_its_row_and_a_zero_row_gives_zeros():
    w = pack(weight("Q8_0", 40, 256)[0])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    x[1, 100] = float("nan")
    x[2] = 0.0
    y = LIB(x, w)
    assert bool(torch.isnan(y[1]).all()) and not bool(torch.isnan(y[0]).any())
    assert torch.equal(y[2], torch.zeros(40))
    x[1, 100] = float("inf")
    assert bool(torch.isnan(LIB(x, w)[1]).all())  # never a finite number from saturation


def test_a_block_too_small_to_scale_counts_as_zeros_in_every_build(built):
    """amax below 1e-30 (127 / amax would overflow): the block is zeros, not an
    undefined conversion of infinity; the other blocks of the row are kept."""
    w = pack(weight("Q4_K", 24, 256)[0])
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    x[0, :32] = 1e-38
    zeroed = x.clone()
    zeroed[0, :32] = 0.0
    assert torch.equal(built(x, w), LIB(zeroed, w, portable=True))


def test_segments_not_repacked_keep_the_exact_path_in_the_same_weight():
    """A fused weight with float parts (F16, F32: a Q3_K tensor is held as F32) between
    repacked ones: their rows are the exact kernel's, the others the int8 path's."""
    parts = [weight(k, n, 512, seed=i) for i, (k, n) in
             enumerate((("Q4_K", 33), ("F16", 20), ("Q6_K", 16), ("F32", 5), ("Q5_0", 18)))]
    fused = concat([p[0] for p in parts])
    packed = pack(fused)
    assert [p is not None for p in packed.packed] == [True, False, True, False, True]
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3))
    got, exact = LIB(x, packed), LIB(x, fused)
    rows = np.cumsum([0] + [p[1].shape[0] for p in parts])
    for i, (lo, hi) in enumerate(zip(rows[:-1], rows[1:])):
        alone = LIB(x, pack(parts[i][0]))
        assert torch.equal(got[:, lo:hi], alone), i
        if i in (1, 3):
            assert torch.equal(got[:, lo:hi], exact[:, lo:hi]), i
    ids = torch.arange(92)  # lookups widen the repacked copy to the blocks' values
    assert torch.equal(LIB.gather(packed, ids).view(torch.int32),
                       LIB.gather(fused, ids).view(torch.int32))


@pytest.mark.parametrize("kind", TYPES)
def test_a_repacked_weight_holds_no_blocks_and_widens_to_their_values(kind):
    """The repacked copy replaces the blocks (a tied head's embedding lookup reads it):
    gather gives gguf.quants.dequantize's floats bit for bit."""
    w, w_ref = weight(kind, 37, 512)
    packed = pack(w)
    assert packed.segments[0][1].is_meta and packed.tensors() == (packed.packed[0],)
    got = LIB.gather(packed, torch.arange(37)).numpy()
    assert np.array_equal(got.view(np.uint32), w_ref.view(np.uint32))


def test_a_repacked_copy_for_a_type_the_kernel_cannot_read_is_refused():
    f16, _ = weight("F16", 16, 256)
    forged = QuantWeight(f16.segments, 256, (torch.zeros(16 * 8 * 544, dtype=torch.uint8),))
    with pytest.raises(ValueError, match="malformed weight"):
        LIB(torch.randn(1, 256), forged)
    with pytest.raises(ValueError, match="one repacked copy"):
        QuantWeight(f16.segments, 256, (None, None))


def test_the_repacked_copy_is_the_files_size_for_fp16_scaled_types():
    """A lone stream reads every weight byte once a token: Q8_0's and Q4_1's repacked
    copies keep the file's bytes a value (4-bit values two to a byte); Q5's and Q6_K's
    take a byte a value, the K-quants fp32 scales and mins (Q6_K its int8 ones)."""
    for kind, per_value in (("Q8_0", 34 / 32), ("Q4_0", 18 / 32), ("Q4_1", 20 / 32),
                            ("Q5_0", 34 / 32), ("Q4_K", 24 / 32), ("Q5_K", 40 / 32),
                            ("Q6_K", 36 / 32)):
        w = pack(weight(kind, 32, 512)[0])
        assert w.packed[0].numel() == 32 * 512 * per_value, kind
