"""Which slice of each weight a tensor-parallel rank holds (Megatron-style).

Attention is split by whole KV groups: a rank holds some KV heads and exactly the
query heads that read them, so GQA never needs a KV head from another rank. Groups
need not split evenly: SmolLM2-135M has 3 KV heads of 3 query heads each, so at
TP=2 rank 0 holds 2 groups (6 q heads) and rank 1 holds 1 (3 q heads). vLLM instead
requires num_heads % tp == 0 (9 % 2 != 0 refuses this model) and replicates KV heads
when tp > num_kv_heads; we refuse tp > num_kv_heads rather than replicate. The MLP
(most of the weights) splits its intermediate dimension as evenly as it goes, and
the vocabulary (embedding and lm_head) splits by rows, so each rank holds about
1/tp of the weights. A mixture-of-experts layer splits by whole experts (as evenly
as they go): a rank runs the routed tokens of the experts it holds and the partial
sums meet in the all-reduce, like a row-parallel layer's. Every split is contiguous: rank r's slice is [start, stop).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from worker_svc.model.config import ModelConfig


def even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n items split into `parts` contiguous runs
    whose sizes differ by at most one (the first ones take the remainder)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    rank: int
    size: int
    kv_heads: tuple[int, int]  # [start, stop) of the KV heads this rank holds
    q_heads: tuple[int, int]  # the query heads of those KV groups
    intermediate: tuple[int, int]  # rows of gate/up, columns of down
    vocab: tuple[int, int]  # rows of the embedding and of lm_head
    experts: tuple[int, int] = (0, 0)  # the routed experts this rank holds whole

    @property
    def first(self) -> bool:
        """Rank 0 adds the row-parallel biases (once, not once per rank) and samples."""
        return self.rank == 0

    @property
    def whole(self) -> bool:
        return self.size == 1

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank sees it: its head counts and MLP width; the vocab
        and hidden sizes stay the model's (logits are gathered whole on rank 0)."""
        return dataclasses.replace(
            cfg, num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0])


def shard_plan(cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
    """Raise ValueError when the model cannot be split over `size` ranks."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {size}")
    if size > cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} exceeds the model's {cfg.num_kv_heads} "
                         "KV heads; each rank needs at least one whole KV group "
                         "(replicating KV heads is not implemented)")
    if size > cfg.intermediate_size or size > cfg.vocab_size:
        raise ValueError(f"tensor_parallel_size {size} is larger than the model")
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
    kv = even_split(cfg.num_kv_heads, size, rank)
    num_experts = cfg.moe.num_experts if cfg.moe is not None else 0
    return ShardPlan(rank=rank, size=size, kv_heads=kv, q_heads=(kv[0] * group, kv[1] * group),
                     intermediate=even_split(cfg.intermediate_size, size, rank),
                     vocab=even_split(cfg.vocab_size, size, rank),
                     experts=even_split(num_experts, size, rank))


def whole_plan(cfg: ModelConfig) -> ShardPlan:
    return shard_plan(cfg, 0, 1)
