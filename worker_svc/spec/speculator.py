"""The worker's speculative decoding, built once at start from --speculative-config
(docs/spec_decode.md): the proposer, the draft model it may run and that model's KV.

The runner asks it for a step's drafts (`draft`), which come as a `VerifyPass`: the
verify pass is the runner's ordinary pass with more logits rows, whose sampling rows
and accepted counts the VerifyPass gives (worker_svc/spec/verify.py), and the runner
commits what it accepts as it commits any sampled token. A draft model's compute plan
is asked of `build_plan` and its weights made ready by `prepare_weights`, as the
served model's are (worker_svc/compute_plan.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.speculative_config import SpeculativeConfig
from shared.telemetry import get_logger
from worker_svc.attention.select import select_backend
from worker_svc.compute_plan import build_plan, has_biases, prepare_weights
from worker_svc.kv_capacity import bytes_per_block
from worker_svc.model.config import layer_windows, load_model_config
from worker_svc.model.llama import DecoderModel
from worker_svc.model.loading.weights import load_weights
from worker_svc.spec.proposers import (DraftModelProposer, NgramProposer,
                                       int8_self_draft_weights)
from worker_svc.spec.verify import VerifyPass
from worker_svc.worker_request import WorkerRequest

log = get_logger(service="worker")


class Speculator:
    def __init__(self, spec: SpeculativeConfig, proposer, tp, device: torch.device,
                 draft_model: DecoderModel | None = None, draft_cfg=None) -> None:
        self.spec = spec
        self.proposer = proposer
        self.tp = tp
        self.device = device
        self.draft_model = draft_model  # a separate checkpoint's, on this rank
        self.draft_cfg = draft_cfg

    # ---------------------------------------------------------------- start-up

    def kv_bytes_per_block(self, block_size: int) -> int:
        """What a separate draft model adds to each KV block on this rank."""
        if self.draft_model is None:
            return 0
        return bytes_per_block(self.draft_cfg, block_size, self.draft_model.dtype)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        if self.draft_model is not None:
            self.proposer.kv_caches = self.draft_model.allocate_kv_caches(num_blocks,
                                                                          block_size)

    # ---------------------------------------------------------------- a step

    def draft(self, states: list[WorkerRequest], slots: list[int], target_kv: list,
              step_id: int) -> VerifyPass:
        """The step's drafts (at most slots[i] for states[i]), as the pass verifies them."""
        return VerifyPass(self.propose(states, slots, target_kv), slots, step_id,
                          self.proposer)

    def propose(self, states: list[WorkerRequest], slots: list[int],
                target_kv: list) -> list[list[int]]:
        """At most slots[i] drafts for states[i], the same on every rank; a request
        with a grammar keeps only the drafts its grammar allows (rank 0 decides)."""
        drafts = self._propose(states, slots, target_kv)
        if any(s.params.structured_output is not None for s in states):
            drafts = self._grammar_valid(states, drafts)
        return drafts

    def _grammar_valid(self, states: list[WorkerRequest],
                       drafts: list[list[int]]) -> list[list[int]]:
        """Each constrained request's drafts cut to the prefix its grammar allows: a
        draft past it could never be sampled (its row is masked) and the verify rows'
        masks need the drafts before them consumed (spec/verify.py). Rank 0 holds
        the matchers; under tensor parallelism it sends the lengths."""
        lengths = [len(d) if s.grammar is None or not d else s.grammar.valid_prefix(d)
                   for s, d in zip(states, drafts)]
        if self.tp is not None:
            t = torch.tensor(lengths, dtype=torch.long, device=self.device)
            self.tp.broadcast_from_first(t)
            lengths = t.tolist()
        return [d[:n] for d, n in zip(drafts, lengths)]

    def _propose(self, states: list[WorkerRequest], slots: list[int],
                 target_kv: list) -> list[list[int]]:
        proposer = self.proposer
        if not proposer.rank0_only or self.tp is None:
            return proposer.propose(states, slots, target_kv) \
                if isinstance(proposer, DraftModelProposer) else proposer.propose(states, slots)
        # a separate draft model runs on rank 0; the others get its drafts
        width = max(slots)
        padded = torch.full((len(states), width), -1, dtype=torch.long, device=self.device)
        if self.tp.rank == 0:
            drafts = proposer.propose(states, slots, target_kv)
            for i, d in enumerate(drafts):
                if d:
                    padded[i, :len(d)] = torch.tensor(d, device=self.device)
        self.tp.broadcast_from_first(padded)
        return [[t for t in row if t >= 0] for row in padded.tolist()]

    def forget(self, state: WorkerRequest) -> None:
        self.proposer.forget(state)

    def summary(self) -> str:
        return self.spec.to_json()


def build_speculator(spec: SpeculativeConfig | None, *, config, device: torch.device,
                     plan, model_cfg, local_cfg, weights, max_model_len: int,
                     block_size: int, tp, first: bool) -> Speculator | None:
    """The speculator of this rank, or None without --speculative-config. Raises
    ValueError (the worker refuses to start) for a draft this worker cannot run."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return Speculator(spec, NgramProposer(spec, max_model_len), tp, device)
    if spec.method != "ngram" and not plan.c_layers:
        raise ValueError(f"speculative method {spec.method!r} runs a llama-family draft "
                         f"on the C layers; model family {plan.family!r} speculates with "
                         "ngram only")
    if spec.is_int8_self_draft:
        draft_plan = build_plan(config, device, local_cfg, biases=has_biases(model_cfg),
                                draft_of=plan, self_draft=True)
        model = DecoderModel(local_cfg, int8_self_draft_weights(weights),
                             select_backend(draft_plan), max_positions=max_model_len,
                             plan=draft_plan, tp=tp)
        log.info("speculator", method="int8_self_draft", k=spec.num_speculative_tokens)
        return Speculator(spec, DraftModelProposer(model, block_size, device,
                                                   shares_kv=True, tp=tp,
                                                   eos_token_ids=model_cfg.eos_token_ids),
                          tp, device)
    draft_cfg = load_model_config(Path(spec.model))
    if draft_cfg.vocab_size != model_cfg.vocab_size:
        raise ValueError(f"draft model {spec.model} has a vocabulary of "
                         f"{draft_cfg.vocab_size}, the served model {model_cfg.vocab_size}: "
                         "a draft model must share the served model's tokenizer")
    if draft_cfg.family != "llama":
        raise ValueError(f"draft model {spec.model} is of model family "
                         f"{draft_cfg.family!r}; a draft model must be of the llama family")
    limit = draft_cfg.max_context or draft_cfg.max_position_embeddings
    if limit < max_model_len:
        raise ValueError(f"draft model {spec.model} handles {limit} positions, fewer than "
                         f"max_model_len {max_model_len}: lower --max-model-len")
    if not first:  # rank 0 drafts alone and broadcasts
        return Speculator(spec, DraftModelProposer(None, block_size, device,
                                                   shares_kv=False), tp, device)
    draft_plan = build_plan(config, device, draft_cfg, biases=has_biases(draft_cfg),
                            windowed=any(layer_windows(draft_cfg, max_model_len)), draft_of=plan)
    with torch.inference_mode():
        w = prepare_weights(load_weights(Path(spec.model), draft_cfg, draft_plan.act_dtype,
                                         device), draft_plan)
    model = DecoderModel(draft_cfg, w, select_backend(draft_plan),
                         max_positions=max_model_len, plan=draft_plan, tp=None)
    log.info("speculator", method="draft_model", model=spec.model,
             k=spec.num_speculative_tokens, draft_layers=draft_cfg.num_layers)
    return Speculator(spec, DraftModelProposer(model, block_size, device, shares_kv=False,
                                               eos_token_ids=model_cfg.eos_token_ids),
                      tp, device, draft_model=model, draft_cfg=draft_cfg)
