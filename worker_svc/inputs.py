"""Input preparation: a step's requests flattened into one batch of token ids,
positions, slot mapping and attention metadata, built with numpy on the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.worker_request import WorkerRequest


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # token rows whose logits are sampled
    sample_rows: list[int]  # which requests (by index in the step) sample
    num_scheduled: list[int]


def prepare_inputs(states: list[WorkerRequest], num_scheduled: list[int], block_size: int,
                   device: torch.device, last_sampled: torch.Tensor) -> StepInputs:
    """Flatten the step into one batch: token ids, positions, slot mapping, metadata."""
    num_reqs = len(states)
    q_lens = np.array(num_scheduled, dtype=np.int64)
    computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    positions = np.repeat(computed - cu[:-1], q_lens) + np.arange(num_tokens)
    seq_lens = computed + q_lens

    input_ids: list[int] = []
    from_device_pos, from_device_rows = [], []
    sample_rows = []
    max_blocks = max(len(s.block_ids) for s in states)
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for i, s in enumerate(states):
        start, end = int(computed[i]), int(seq_lens[i])
        input_ids.extend(s.token_ids[start:end])
        block_table[i, :len(s.block_ids)] = s.block_ids
        if end == len(s.token_ids):
            sample_rows.append(i)
            if s.num_output_tokens > 0:  # its last input token is one this worker sampled
                from_device_pos.append(int(cu[i + 1]) - 1)
                from_device_rows.append(s.row)
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    slots = block_table[req_of_token, positions // block_size] * block_size \
        + positions % block_size
    logits_indices = cu[1:][sample_rows] - 1

    def dev(a, dtype=torch.long):
        return torch.as_tensor(a, dtype=dtype).to(device, non_blocking=True)

    ids = dev(input_ids)
    if from_device_pos:
        ids[dev(from_device_pos)] = last_sampled[dev(from_device_rows)]
    meta = AttentionMetadata(
        slot_mapping=dev(slots), query_start_loc=dev(cu, torch.int32),
        seq_lens=dev(seq_lens, torch.int32), block_table=dev(block_table, torch.int32),
        max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()))
    return StepInputs(ids, dev(positions), meta, dev(logits_indices), sample_rows,
                      num_scheduled)
