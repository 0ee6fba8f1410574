"""Every family and variant computes transformers' float32 logits over the paged KV
cache: in one shot, prefilled in chunks across steps, and (YaRN) past the config's
max_position_embeddings. The MoE layer runs only the routed experts."""

from __future__ import annotations

import pytest
import torch

from tests.families.conftest import VARIANTS
from tests.worker.test_model_matches_transformers import (_chunk_logits, _prompt,
                                                          _relative_error, _state)
from worker_svc.config import WorkerConfig
from worker_svc.model import layers
from worker_svc.runner import ModelRunner


def _runner(path, max_model_len: int = 256) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), device="cpu", max_model_len=max_model_len,
                                    num_gpu_blocks_override=64, max_num_seqs=8))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_full_prompt_logits_match_transformers(name, family_dir, hf_model_cache):
    path = family_dir(name)
    prompt = _prompt(0, 83)
    got = _chunk_logits(_runner(path), _state(prompt), len(prompt))
    with torch.no_grad():
        want = hf_model_cache(path)(torch.tensor([prompt])).logits[0]
    assert _relative_error(got, want) < 1e-4


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prompt_prefilled_in_chunks_gives_one_shot_logits(name, family_dir):
    path = family_dir(name)
    prompt = _prompt(1, 70)
    one_shot = _chunk_logits(_runner(path), _state(prompt), len(prompt))
    runner, state = _runner(path), _state(prompt)
    chunks = [_chunk_logits(runner, state, n) for n in (7, 16, 30, 1, 16)]
    assert _relative_error(torch.cat(chunks), one_shot) < 1e-5


def test_yarn_logits_match_transformers_past_max_position_embeddings(family_dir, hf_model_cache):
    """max_position_embeddings 64, YaRN x4: positions 0..199 all match."""
    path = family_dir("qwen2_yarn")
    prompt = _prompt(2, 200)
    runner = _runner(path, max_model_len=256)
    state = _state(prompt)
    state.block_ids = list(range(1, 14))  # 13 blocks of 16 hold 200 tokens
    chunks = [_chunk_logits(runner, state, n) for n in (64, 64, 72)]
    with torch.no_grad():
        want = hf_model_cache(path)(torch.tensor([prompt])).logits[0]
    assert _relative_error(torch.cat(chunks), want) < 1e-4


def _moe_case(renormalize: bool, experts: int = 6, top_k: int = 2, tokens: int = 9):
    g = torch.Generator().manual_seed(3)
    spec = layers.MoeSpec(num_experts=experts, top_k=top_k, intermediate_size=8,
                          renormalize=renormalize)
    w = layers.MoeWeights(router=torch.randn(experts, 16, generator=g),
                          gate_up=torch.randn(experts, 16, 16, generator=g) * 0.3,
                          down=torch.randn(experts, 16, 8, generator=g) * 0.3, first=0)
    return spec, w, torch.randn(tokens, 16, generator=g)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_equals_softmax_topk_renormalise_over_each_tokens_experts(renormalize):
    spec, w, x = _moe_case(renormalize)
    probs = torch.softmax(x @ w.router.T, dim=-1)
    top, ids = probs.topk(spec.top_k, dim=-1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(top[t], ids[t]):
            want[t] += weight * layers.gated_mlp(x[t:t + 1], w.gate_up[e], w.down[e])[0]
    torch.testing.assert_close(layers.moe(x, w, spec), want, rtol=1e-5, atol=1e-6)


def test_moe_computes_only_the_routed_experts():
    """Poison every expert no token routes to with NaN: a dense all-experts pass
    (even one multiplied by zero weights) would turn the output NaN."""
    spec, w, x = _moe_case(True, experts=8, top_k=2, tokens=3)
    _, ids = layers.route(x @ w.router.T, spec)
    unused = sorted(set(range(8)) - set(ids.flatten().tolist()))
    assert unused  # 3 tokens x top-2 leave some of 8 experts idle
    want = layers.moe(x, w, spec)
    w.gate_up[unused] = float("nan")
    w.down[unused] = float("nan")
    assert torch.equal(layers.moe(x, w, spec), want)


def test_experts_split_across_ranks_sum_to_the_whole_layer():
    """Rank r holds experts [first, stop) whole: the partial sums add to the layer."""
    from worker_svc.parallel.shard import even_split
    spec, w, x = _moe_case(False, experts=5, top_k=3)
    parts = []
    for rank in range(2):
        first, stop = even_split(5, 2, rank)
        parts.append(layers.moe(x, layers.MoeWeights(w.router, w.gate_up[first:stop],
                                                     w.down[first:stop], first), spec))
    torch.testing.assert_close(parts[0] + parts[1], layers.moe(x, w, spec))


def test_bf16_on_cpu_runs_a_torch_family_with_bf16_matmul_weights(family_dir, hf_model_cache):
    """--dtype bfloat16 on CPU: bf16 matmul weights (experts included) under fp32
    activations, as the llama family's; close to the fp32 logits, not equal. (Mixtral:
    the Qwen3 variants' sharp q/k norms magnify bf16's rounding to ~0.1 here, as 0.005
    with those norms at 1 shows.)"""
    path = family_dir("mixtral")
    runner = ModelRunner(WorkerConfig(model=str(path), device="cpu", dtype="bfloat16",
                                      max_model_len=256, num_gpu_blocks_override=64,
                                      max_num_seqs=8))
    assert "dtype=bfloat16/float32" in runner.compute_plan.summary().split()
    assert runner.model.w.layers[0].mlp.gate_up.dtype == torch.bfloat16
    prompt = _prompt(4, 40)
    got = _chunk_logits(runner, _state(prompt), len(prompt))
    with torch.no_grad():
        want = hf_model_cache(path)(torch.tensor([prompt])).logits[0]
    assert _relative_error(got, want) < 0.03


def test_a_shared_expert_held_by_the_first_rank_keeps_the_partial_sums_whole():
    """Qwen2-MoE: every token also passes the shared expert, scaled by sigmoid(its
    gate); the rank holding expert 0 holds it, so the ranks' partial sums still add
    to the layer."""
    from worker_svc.parallel.shard import even_split
    spec, w, x = _moe_case(True, experts=5, top_k=2)
    g = torch.Generator().manual_seed(3)
    shared = dict(shared_gate_up=torch.randn(24, 16, generator=g) * 0.3,
                  shared_down=torch.randn(16, 12, generator=g) * 0.3,
                  shared_gate=torch.randn(1, 16, generator=g))
    whole = layers.moe(x, layers.MoeWeights(w.router, w.gate_up, w.down, 0, **shared), spec)
    routed = layers.moe(x, w, spec)
    want = routed + torch.sigmoid(x @ shared["shared_gate"].T) * layers.gated_mlp(
        x, shared["shared_gate_up"], shared["shared_down"])
    torch.testing.assert_close(whole, want)
    parts = []
    for rank in range(2):
        first, stop = even_split(5, 2, rank)
        parts.append(layers.moe(x, layers.MoeWeights(
            w.router, w.gate_up[first:stop], w.down[first:stop], first,
            **(shared if first == 0 else {})), spec))
    torch.testing.assert_close(parts[0] + parts[1], whole)


@pytest.mark.parametrize("shape", [(1, 640), (7, 640), (64, 1152), (3, 4, 256), (5, 1, 32)])
def test_gemma_norm_has_the_reference_steps_bits(shape):
    """Gemma's (1 + w) RMSNorm through the fused kernel gives the bits of transformers'
    steps (normalize in fp32, then times 1 + w), at every shape a layer norms."""
    g = torch.Generator().manual_seed(shape[0])
    for scale in (1e-3, 1.0, 30.0):
        x = torch.randn(shape, generator=g) * scale
        w = torch.randn(shape[-1], generator=g) * 0.3
        xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        want = xf * (1.0 + w)
        got = layers.rms_norm_one_plus(x, w, 1e-6)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
