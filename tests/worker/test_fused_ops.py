"""The C element-wise decoder ops compute what transformers' layers compute: RoPE
and the residual adds bit for bit, RMSNorm to within a few ulp (its mean of squares is
summed in another order), SiLU * up within a few ulp (its own exp), and the KV write
lands in the right slots. Each ISA build this CPU runs is checked, as an image ships
them all (worker_svc/native.py)."""

import ctypes

import pytest
import torch

from worker_svc import native
from worker_svc.model.cpu import fused_ops

pytestmark = pytest.mark.skipif(
    fused_ops.load() is None,
    reason="no C compiler here: the torch ops run instead")


@pytest.fixture(params=[v.name for v in native.supported_variants()])
def ops(request):
    variant = next(v for v in native.supported_variants() if v.name == request.param)
    path = native.compile_variant("decoder_ops", variant, fused_ops.FLAGS)
    assert path is not None  # a compiler is here: active() built the best one above
    return fused_ops.FusedOps(ctypes.PyDLL(str(path)))


def hf_rms_norm(x, weight, eps):  # LlamaRMSNorm.forward, fp32
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def hf_rope(x, cos, sin):  # apply_rotary_pos_emb on [tokens, heads, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def rope_tables(max_pos, head_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.arange(max_pos).float()[:, None] * inv_freq
    emb = torch.cat((emb, emb), dim=-1)
    sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
    return emb.cos(), emb.sin(), (emb.sin() * sign).contiguous()


def test_rms_norm_matches_the_reference_within_a_few_ulp_on_strided_rows(ops):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2 * 576, generator=g)[:, 100:676]  # rows of a wider tensor
    weight = torch.randn(576, generator=g)
    got = ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, hf_rms_norm(x, weight, 1e-5), rtol=3e-7, atol=1e-7)


def test_add_rms_norm_updates_the_residual_exactly_and_normalizes_it(ops):
    g = torch.Generator().manual_seed(1)
    residual, delta = torch.randn(5, 576, generator=g), torch.randn(5, 576, generator=g)
    weight = torch.randn(576, generator=g)
    want_residual = residual + delta
    got = ops.add_rms_norm(residual, delta, weight, 1e-6)
    assert torch.equal(residual, want_residual)
    torch.testing.assert_close(got, hf_rms_norm(want_residual, weight, 1e-6),
                               rtol=3e-7, atol=1e-7)


def test_silu_mul_matches_torch_within_a_few_ulp_across_the_float_range(ops):
    g = torch.Generator().manual_seed(3)
    gate = torch.cat([torch.randn(3, 1536, generator=g) * s for s in (0.01, 1.0, 8.0, 60.0)])
    gate[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # saturated exp, and zeros
    up = torch.randn(gate.shape, generator=g)
    got = ops.silu_mul(torch.cat([gate, up], dim=1))
    want = torch.nn.functional.silu(gate) * up
    ulps = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
    assert ulps.max() <= 8 and (got == want).float().mean() > 0.98
    assert torch.isfinite(got).all()


def test_gelu_tanh_mul_matches_torch_within_a_few_ulp_across_the_float_range(ops):
    """Gemma's GeGLU as the C loop computes it (g / (1 + e^-2u), the same function as
    0.5 g (1 + tanh u)) against torch's F.gelu(approximate="tanh"): within a few ulp
    where gelu is not small; where it tends to 0 (g below about -1) torch's 1 + tanh
    cancels, and both sit within a few ulp of g of float64's value."""
    g = torch.Generator().manual_seed(4)
    gate = torch.cat([torch.randn(3, 2048, generator=g) * s for s in (0.01, 1.0, 4.0, 30.0)])
    gate[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # saturated exp, and zeros
    up = torch.randn(gate.shape, generator=g)
    got = ops.gelu_tanh_mul(torch.cat([gate, up], dim=1))
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    exact = torch.nn.functional.gelu(gate.double(), approximate="tanh") * up.double()
    assert torch.isfinite(got).all()
    scale = (gate.abs() + 1e-3) * up.abs()
    assert ((got - want).abs() <= 6e-7 * scale).all()
    assert ((got.double() - exact).abs() <= 6e-7 * scale).all()
    not_small = gate > -0.5
    ulp_ok = (got - want).abs() <= 5e-7 * want.abs() + 1e-38
    assert ulp_ok[not_small].float().mean() > 0.995


def test_rope_is_bit_identical_to_the_reference_and_kv_lands_in_its_slots(ops):
    heads, kv_heads, hd, rows, block_size, num_blocks = 9, 3, 64, 6, 4, 5
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g)
    before = qkv.clone()
    cos, sin, signed_sin = rope_tables(64, hd)
    positions = torch.tensor([0, 1, 17, 40, 63, 5])
    slots = torch.tensor([4, 5, 6, -1, 19, 0])  # -1: a padding row, written nowhere
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, hd)
    ops.rope_write_kv(qkv, heads, kv_heads, hd, cos, signed_sin, positions, kv_cache, slots)

    q = before[:, :heads * hd].view(rows, heads, hd)
    k = before[:, heads * hd:(heads + kv_heads) * hd].view(rows, kv_heads, hd)
    v = before[:, (heads + kv_heads) * hd:].view(rows, kv_heads, hd)
    want_q, want_k = hf_rope(q, cos[positions], sin[positions]), hf_rope(k, cos[positions],
                                                                          sin[positions])
    assert torch.equal(qkv[:, :heads * hd].view(rows, heads, hd), want_q)
    assert torch.equal(qkv[:, heads * hd:(heads + kv_heads) * hd].view(rows, kv_heads, hd),
                       want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * hd:], before[:, (heads + kv_heads) * hd:])
    flat_k, flat_v = kv_cache[0].view(-1, kv_heads, hd), kv_cache[1].view(-1, kv_heads, hd)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], want_k[row]) and torch.equal(flat_v[slot], v[row])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("position, slot", [(64, 3), (-1, 3), (3, 20)])
def test_a_position_or_slot_out_of_range_raises_and_writes_nothing(ops, position, slot):
    qkv = torch.randn(2, 5 * 64)
    before = qkv.clone()
    cos, _, signed_sin = rope_tables(64, 64)
    kv_cache = torch.zeros(2, 5, 4, 1, 64)
    with pytest.raises(ValueError, match="out of range|beyond"):
        ops.rope_write_kv(qkv, 3, 1, 64, cos, signed_sin, torch.tensor([0, position]),
                          kv_cache, torch.tensor([1, slot]))
    assert torch.equal(qkv, before) and not kv_cache.any()


def test_only_int64_contiguous_positions_and_slots_within_the_token_limit_take_the_c_ops():
    ids, pos = torch.zeros(4, dtype=torch.long), torch.arange(4)
    assert fused_ops.takes(ids, pos, pos + 16)
    assert not fused_ops.takes(ids, pos.int(), pos + 16)
    assert not fused_ops.takes(ids, pos, torch.arange(8)[::2])
    many = torch.zeros(fused_ops.MAX_TOKENS + 1, dtype=torch.long)
    assert not fused_ops.takes(many, torch.arange(many.shape[0]), torch.arange(many.shape[0]))
