"""Input preparation: a step's requests flattened into one batch of token ids,
positions, slot mapping and attention metadata, built with numpy on the host.

`sequence_inputs` is the one builder: per request, a chunk of token ids starting at a
position, how many of its last rows get logits, and whether attention sees it as one
sequence (a prefill chunk) or as one single-token decode row per token (`split`). A
verify pass of speculative decoding (the last token and its drafts) is split: each
position attends to the cache up to itself, written in the same layer before the
attention reads it, so the C decode kernel (and the one-call layer loop) takes it as
it takes decodes, instead of a masked SDPA per request and layer.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    num_logits: list[int]  # per sampling request: its logits rows (1 + drafts)


def sequence_inputs(chunks: Sequence[Sequence[int]], starts: Sequence[int],
                    tables: Sequence[Sequence[int]], block_size: int, device: torch.device,
                    num_logits: Sequence[int], split: Sequence[bool] | None = None
                    ) -> StepInputs:
    """chunks[i]: request i's input token ids, at positions starts[i], starts[i] + 1, ...
    in the blocks tables[i]; its last num_logits[i] rows get logits (0: none);
    split[i]: attention sees each of its tokens as a decode row of its own."""
    num_reqs = len(chunks)
    q_lens = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=num_reqs)
    computed = np.asarray(starts, dtype=np.int64)
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    positions = np.repeat(computed - cu[:-1], q_lens) + np.arange(num_tokens)
    seq_lens = computed + q_lens
    input_ids: list[int] = []
    for c in chunks:
        input_ids.extend(c)
    max_blocks = max(len(t) for t in tables)
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for i, t in enumerate(tables):
        block_table[i, :len(t)] = t
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    slots = block_table[req_of_token, positions // block_size] * block_size \
        + positions % block_size
    sample_rows = [i for i in range(num_reqs) if num_logits[i]]
    counts = [int(num_logits[i]) for i in sample_rows]
    if all(n == 1 for n in counts):  # the usual step: each request's last row
        logits_indices = cu[1:][sample_rows] - 1
    else:
        logits_indices = np.concatenate(
            [np.arange(cu[i + 1] - n, cu[i + 1]) for i, n in zip(sample_rows, counts)])
    attn_cu, attn_lens, attn_table = cu, seq_lens, block_table
    if split is not None and any(split):  # each token of a split request: its own row
        rows_of = np.where(np.asarray(split, dtype=bool), q_lens, 1)
        row_req = np.repeat(np.arange(num_reqs), rows_of)
        row_q = np.where(np.repeat(np.asarray(split, dtype=bool), rows_of), 1,
                         q_lens[row_req])
        attn_cu = np.zeros(len(row_req) + 1, dtype=np.int64)
        np.cumsum(row_q, out=attn_cu[1:])
        attn_lens = positions[attn_cu[1:] - 1] + 1  # a row ends at its last token
        attn_table = block_table[row_req]

    def dev(a, dtype=torch.long):
        return torch.as_tensor(a, dtype=dtype).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=dev(slots), query_start_loc=dev(attn_cu, torch.int32),
        seq_lens=dev(attn_lens, torch.int32), block_table=dev(attn_table, torch.int32),
        max_query_len=int(np.diff(attn_cu).max()), max_seq_len=int(attn_lens.max()))
    return StepInputs(dev(input_ids), dev(positions), meta, dev(logits_indices),
                      sample_rows, [int(q) for q in q_lens], counts)


def prepare_inputs(states: list[WorkerRequest], num_scheduled: list[int], block_size: int,
                   device: torch.device, last_sampled: torch.Tensor,
                   drafts: Sequence[Sequence[int]] | None = None) -> StepInputs:
    """Flatten the step: request i computes num_scheduled[i] positions from its
    num_computed_tokens. drafts[i] (speculative decoding): its last token is followed
    by these drafts, its num_scheduled[i] counting them; the pass verifies them, so
    every one of its positions gets logits, and it is split (module docstring)."""
    chunks, starts, tables, num_logits, split = [], [], [], [], []
    from_device_pos, from_device_rows = [], []
    offset = 0
    for i, (s, n) in enumerate(zip(states, num_scheduled)):
        d = drafts[i] if drafts is not None else ()
        start, end = s.num_computed_tokens, s.num_computed_tokens + n - len(d)
        chunk = s.token_ids[start:end]
        if d:
            chunk = [*chunk, *d]
        chunks.append(chunk)
        starts.append(start)
        tables.append(s.block_ids)
        samples = end == len(s.token_ids)
        num_logits.append(1 + len(d) if samples else 0)
        split.append(bool(d))
        if samples and s.num_output_tokens > 0:  # its last input token is one it sampled
            from_device_pos.append(offset + end - start - 1)
            from_device_rows.append(s.row)
        offset += len(chunk)
    inputs = sequence_inputs(chunks, starts, tables, block_size, device, num_logits,
                             split if drafts is not None else None)
    if from_device_pos:
        ids = inputs.input_ids
        ids[torch.as_tensor(from_device_pos, device=device)] = \
            last_sampled[torch.as_tensor(from_device_rows, device=device)]
    return inputs
