"""Who fills a step's draft slots (docs/spec_decode.md, "Where drafts are proposed").

The worker holds every request's tokens, the ones it just sampled included, so it
proposes the drafts of a step the moment the step arrives; the scheduler only
reserved the slots. Three proposers, one interface (`propose(states, slots)` -> one
list of draft ids per request, at most its slots; `verified(state, ...)` after the
verify pass):

- `NgramProposer`: prompt lookup over prompt + output (worker_svc/spec/ngram.py), no
  model. Every tensor-parallel rank finds the same drafts in the same tokens.
- `DraftModelProposer` on the served model's own int8 copy (the self-draft): the
  small-batch kernel's int8 weights (model/cpu/small_linear.py) run k greedy passes of
  one token a request. It shares the target's paged KV: a draft pass writes its
  provisional K/V at the positions it computes, and the verify pass that follows in
  the same step writes the target's own K/V at every one of them before any
  attention reads them, so the cache ends exactly as without drafts, and the draft
  attends to the target's exact KV of everything committed. Every rank takes part
  (the int8 copy is split like the model); rank 0 picks each token and broadcasts it.
- `DraftModelProposer` on a smaller checkpoint with the same tokenizer: its own paged
  KV, in the same block ids (the worker sized the pool for both at start, so the
  handshake's block count holds both), caught up lazily: a request's first pass
  computes the draft's KV of every token it has not seen yet (`draft_state` counts
  them; a new, resumed or resent request starts from 0, since prefix-cache blocks
  need not hold the draft's KV). Only rank 0 holds it; the drafts are broadcast.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from shared.speculative_config import SpeculativeConfig
from worker_svc.inputs import sequence_inputs
from worker_svc.grammar import apply_masks
from worker_svc.model.cpu import small_linear
from worker_svc.model.cpu.decode_layers import MATMULS
from worker_svc.model.loading.weights import ModelWeights
from worker_svc.spec import ngram
from worker_svc.worker_request import WorkerRequest


class NgramProposer:
    rank0_only = False

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.k, self.lo, self.hi = (spec.num_speculative_tokens, spec.prompt_lookup_min,
                                    spec.prompt_lookup_max)
        self.max_model_len = max_model_len

    def propose(self, states: list[WorkerRequest], slots: list[int]) -> list[list[int]]:
        return [ngram.propose(_token_array(s), d, self.lo, self.hi,
                              self.max_model_len).tolist() if d else []
                for s, d in zip(states, slots)]

    def verified(self, state: WorkerRequest, num_tokens_before: int, num_drafts: int,
                 num_accepted: int) -> None:
        pass

    def forget(self, state: WorkerRequest) -> None:
        pass  # its array follows the tokens, which a preemption keeps


def _token_array(state: WorkerRequest) -> np.ndarray:
    """The request's tokens as an int64 array, kept in its draft_state and extended by
    what was appended since (a step appends a few): no list-to-array copy of the
    whole context every step."""
    n = len(state.token_ids)
    buf, have = state.draft_state if state.draft_state is not None else (None, 0)
    if buf is None or buf.shape[0] < n:
        grown = np.empty(max(64, 2 * n), dtype=np.int64)
        if have:
            grown[:have] = buf[:have]
        buf = grown
    if have < n:
        buf[have:n] = state.token_ids[have:n]
    state.draft_state = (buf, n)
    return buf[:n]


class DraftModelProposer:
    """k greedy passes of a draft model, batched over the requests with slots: pass j
    computes one position a request (after pass 0's catch-up) and proposes the next."""

    def __init__(self, model, block_size: int, device: torch.device, *, shares_kv: bool,
                 kv_caches: list | None = None, tp=None,
                 eos_token_ids: list[int] = ()) -> None:
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.block_size = block_size
        self.device = device
        self.shares_kv = shares_kv
        self.kv_caches = kv_caches  # None while sharing: the runner passes its own
        self.tp = tp  # set for the self-draft under tensor parallelism
        self.rank0_only = not shares_kv  # a separate draft model lives on rank 0 only

    def propose(self, states: list[WorkerRequest], slots: list[int],
                target_kv: list | None = None) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in states]
        active = [i for i, d in enumerate(slots) if d]
        kv = target_kv if self.shares_kv else self.kv_caches
        # a request with a grammar drafts under its mask (rank 0 holds the matchers):
        # each pass's token is consumed, and all are rolled back at the end
        consumed = {i: 0 for i in active if states[i].grammar is not None}
        chunks, starts = [], []
        for i in active:
            s = states[i]
            start = len(s.token_ids) - 1 if self.shares_kv else self._draft_computed(s)
            chunks.append(s.token_ids[start:])
            starts.append(start)
        while active:
            inputs = sequence_inputs(chunks, starts, [states[i].block_ids for i in active],
                                     self.block_size, self.device, [1] * len(active))
            masked = [states[i] for i in active] if consumed else None
            logits = self.model.forward(inputs.input_ids, inputs.positions, kv, inputs.meta,
                                        inputs.logits_indices, argmax_only=not consumed)
            if masked is not None and logits is not None:
                apply_masks(logits, masked, self.eos_token_ids)
            for i, token in zip(active, self._pick(logits, len(active))):
                drafts[i].append(token)
                if i in consumed:
                    consumed[i] += states[i].grammar.consume_draft(token)
            active = [i for i in active if len(drafts[i]) < slots[i]]
            chunks = [[drafts[i][-1]] for i in active]
            starts = [len(states[i].token_ids) - 1 + len(drafts[i]) for i in active]
        for i, n in consumed.items():
            states[i].grammar.rollback(n)
        return drafts

    def _pick(self, logits: torch.Tensor | None, rows: int) -> list[int]:
        """Each row's argmax (one-hot drafts); under tensor parallelism rank 0 has the
        logits and broadcasts the tokens, which every rank's next pass takes as input."""
        if self.tp is None:
            return logits.argmax(dim=-1).tolist()
        tokens = logits.argmax(dim=-1) if logits is not None else \
            torch.empty(rows, dtype=torch.long, device=self.device)
        self.tp.broadcast_from_first(tokens)
        return tokens.tolist()

    @staticmethod
    def _draft_computed(state: WorkerRequest) -> int:
        return state.draft_state if isinstance(state.draft_state, int) else 0

    def verified(self, state: WorkerRequest, num_tokens_before: int, num_drafts: int,
                 num_accepted: int) -> None:
        """A separate draft's KV is valid up to the last token it computed that was
        committed: the tokens it had, and the accepted drafts it took as input (a pass
        takes draft j as input only if j < the number proposed)."""
        if not self.shares_kv and num_drafts:
            state.draft_state = num_tokens_before + min(num_accepted, num_drafts - 1)

    def forget(self, state: WorkerRequest) -> None:
        """Its blocks were replaced (a preemption's resume): nothing of the draft's
        KV is there."""
        if not self.shares_kv:
            state.draft_state = 0


def int8_self_draft_weights(weights: ModelWeights) -> ModelWeights:
    """The served model with int8 copies of its matmul weights and vocabulary
    projection for the small-batch kernel (steps of up to INT8_MAX_ROWS tokens; wider
    draft passes read the served weights themselves). Under --quantization int8 the
    served model's own small-step copies are those already."""
    plain = weights.plain_layers or weights.layers
    if isinstance(plain[0].qkv, small_linear.Int8Weight):
        return weights
    if any(getattr(lw, n).is_mkldnn for lw in plain for n in MATMULS):
        raise ValueError("the int8 self-draft quantizes the row-major weights, and "
                         "this worker keeps only prepacked ones")
    layers = [dataclasses.replace(lw, **{n: small_linear.quantize_int8(getattr(lw, n))
                                         for n in MATMULS}) for lw in plain]
    head = weights.argmax_screen  # the screen's int8 projection is the same copy
    if head is None:
        plain_head = weights.plain_lm_head if weights.plain_lm_head is not None \
            else weights.lm_head
        head = small_linear.quantize_int8(plain_head)
    return ModelWeights(embed=weights.embed, layers=weights.layers,
                        final_norm=weights.final_norm, lm_head=weights.lm_head,
                        plain_layers=layers, plain_lm_head=head)
