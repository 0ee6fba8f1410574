"""Tensor-parallel sharding: attention splits by whole KV groups (uneven where the
groups are), the MLP and the vocabulary as evenly as they go, and each rank loads
exactly its slices of the checkpoint, about 1/tp of the weights."""

from pathlib import Path

import pytest
import torch

from shared.model_files.default_model import resolve_model
from worker_svc.model.config import load_model_config
from worker_svc.model.loading.weights import load_weights, weight_bytes
from worker_svc.parallel.shard import even_split, shard_plan

CPU = torch.device("cpu")


def test_even_split_covers_every_item_once_with_sizes_within_one():
    for n, parts in [(3, 2), (1536, 2), (49152, 3), (7, 7), (10, 4)]:
        runs = [even_split(n, parts, i) for i in range(parts)]
        assert runs[0][0] == 0 and runs[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        assert max(b - a for a, b in runs) - min(b - a for a, b in runs) <= 1


@pytest.mark.e2e
def test_smollm2_at_tp2_splits_three_kv_groups_two_and_one_and_the_mlp_in_halves():
    cfg = load_model_config(resolve_model(None))
    assert (cfg.num_heads, cfg.num_kv_heads) == (9, 3)  # 9 % 2 != 0: per-head split fails
    first, second = shard_plan(cfg, 0, 2), shard_plan(cfg, 1, 2)
    assert (first.kv_heads, first.q_heads) == ((0, 2), (0, 6))
    assert (second.kv_heads, second.q_heads) == ((2, 3), (6, 9))
    assert (first.intermediate, second.intermediate) == ((0, 768), (768, 1536))
    assert (first.vocab, second.vocab) == ((0, 24576), (24576, 49152))
    local = second.local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 768)


def test_more_ranks_than_kv_heads_are_refused_with_the_reason(tiny_llama_dir):
    cfg = load_model_config(Path(tiny_llama_dir))
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        shard_plan(cfg, 0, cfg.num_kv_heads + 1)


def test_each_rank_loads_exactly_its_slices_of_the_whole_weights(tiny_qwen2_dir):
    model_dir = Path(tiny_qwen2_dir)  # qwen2: q/k/v carry biases, sliced like the rows
    cfg = load_model_config(model_dir)
    whole = load_weights(model_dir, cfg, torch.float32, CPU)
    hd, nq, nkv = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    for rank in range(2):
        plan = shard_plan(cfg, rank, 2)
        part = load_weights(model_dir, cfg, torch.float32, CPU, plan)
        q0, q1 = (h * hd for h in plan.q_heads)
        k0, k1 = (h * hd for h in plan.kv_heads)
        i0, i1 = plan.intermediate
        v0, v1 = plan.vocab
        assert torch.equal(part.embed, whole.embed[v0:v1])
        assert torch.equal(part.lm_head, whole.lm_head[v0:v1])
        assert torch.equal(part.final_norm, whole.final_norm)
        for w, lw in zip(whole.layers, part.layers):
            rows = [*range(q0, q1), *range(nq + k0, nq + k1), *range(nq + nkv + k0, nq + nkv + k1)]
            assert torch.equal(lw.qkv, w.qkv[rows])
            assert torch.equal(lw.qkv_bias, w.qkv_bias[rows])
            assert torch.equal(lw.o_proj, w.o_proj[:, q0:q1])
            assert torch.equal(lw.gate_up, w.gate_up[[*range(i0, i1),
                                                      *range(inter + i0, inter + i1)]])
            assert torch.equal(lw.down, w.down[:, i0:i1])
            assert torch.equal(lw.input_norm, w.input_norm)


@pytest.mark.e2e
def test_per_rank_weight_memory_on_the_default_model_is_about_half():
    model_dir = resolve_model(None)
    cfg = load_model_config(model_dir)
    whole = weight_bytes(load_weights(model_dir, cfg, torch.float32, CPU))
    ranks = [weight_bytes(load_weights(model_dir, cfg, torch.float32, CPU,
                                       shard_plan(cfg, r, 2))) for r in range(2)]
    # rank 0 holds two of the three KV groups; the MLP and vocab halves dominate
    assert all(0.45 * whole < r < 0.55 * whole for r in ranks), (whole, ranks)
    replicated_norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    assert sum(ranks) == whole + replicated_norms
