"""Tensor parallelism: how a model splits over ranks (shard) and the process group
the ranks run their collectives in (group)."""
