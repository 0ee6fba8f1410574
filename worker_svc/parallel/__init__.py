"""Tensor parallelism: how a model splits over ranks (shard) and the process group
the ranks run their collectives in (group)."""


class GroupLost(RuntimeError):
    """A collective failed or timed out, or a peer stopped beating: the group is gone.
    Here, not in group.py, so the gRPC server can name it without importing
    torch.distributed."""
