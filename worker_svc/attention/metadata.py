"""Per-step attention metadata, built once per step and shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = skip (padding token)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length including this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # what a backend derives from the above once per step and reuses in every layer
    backend_state: Any = None
    # the same, without the C decode kernel, for layers with a sliding window (by
    # window) or capped scores (key None)
    windowed_states: dict | None = None

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
