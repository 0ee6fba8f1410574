"""ModelRunner: one SchedulerOutput in, one forward pass over the paged KV cache,
one ModelRunnerOutput out.

Every scheduled token of every request (prefill chunks and decodes alike) is
flattened into one batch, so a step is one forward pass whatever its mix. Steps
must arrive strictly in order: a block freed by one request and handed to another
is written by the new owner only in a later step, after the old owner's last use.
The token a request sampled is kept in a device tensor and gathered into its next
input on the device; under async scheduling the next step may be sent before the
sampled ids ever reach the host.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from shared.kv_window import max_blocks_per_request
from shared.model_files.default_model import resolve_model
from shared.model_files.gguf_model import gguf_source
from shared.telemetry import get_logger
from shared.types import (InvalidRequestError, ModelInfo, ModelRunnerOutput,
                          SchedulerOutput, StepTimings)
from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.attention.select import select_backend
from worker_svc.compute_plan import build_plan, has_biases, prepare_weights
from worker_svc.config import WorkerConfig
from worker_svc import fault_injection
from worker_svc.inputs import prepare_inputs
from worker_svc.kv_capacity import (KvAccounting, bytes_per_block, cpu_num_blocks,
                                    cuda_num_blocks, usable_blocks)
from worker_svc.model.config import kv_window, layer_windows, load_model_config
from worker_svc.model.cpu.cpu_dtype import native_bf16
from worker_svc.model.layers import longrope_rows
from worker_svc.model.loading.dummy_weights import dummy_weights
from worker_svc.model.cpu import quant_weights
from worker_svc.model.loading.gguf_quantized import held_types, load_quantized_weights
from worker_svc.model.loading.gguf_tensors import matmul_types
from worker_svc.model.registry import FAMILIES
from worker_svc.model.loading.weights import weight_bytes
from worker_svc.parallel.shard import shard_plan
from worker_svc.worker_request import WorkerRequest
from worker_svc.grammar import GrammarRuntime, apply_masks
from worker_svc.sampler import sample
from worker_svc.spec.speculator import build_speculator
from worker_svc.spec.verify import VerifyPass
from worker_svc.step_check import check_step
from worker_svc.zero_cost import zero_cost_step

log = get_logger(service="worker")


class ModelRunner:
    def __init__(self, config: WorkerConfig) -> None:
        config.validate()
        self.config = config
        self.device = _resolve_device(config.device, config.tensor_parallel_rank,
                                      config.tensor_parallel_size)
        self.model_dir = resolve_model(None if config.model is None else str(config.model))
        self.model_config = cfg = load_model_config(self.model_dir)
        self._eos = frozenset(cfg.eos_token_ids)  # a request's stop rule needs them
        self.max_model_len = _resolve_max_model_len(config.max_model_len, cfg)
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens \
            or default_max_num_batched_tokens(self.device)
        # the whole model when tensor_parallel_size is 1; this rank's slice otherwise
        self.plan = shard_plan(cfg, config.tensor_parallel_rank, config.tensor_parallel_size)
        self.local_config = self.plan.local_config(cfg)
        self.tp = None if self.plan.whole else _join_group(self.plan, config, self.device)
        # every choice of how steps compute, once (compute_plan.py); steps only follow it
        self.compute_plan = plan = build_plan(
            config, self.device, self.local_config, biases=has_biases(cfg),
            windowed=any(layer_windows(cfg, self.max_model_len)),
            ranks_on_host=1 if self.tp is None else self.tp.ranks_on_this_host(),
            fault_stop_after_steps=config.fault_stop_after_steps,
            fault_fail_on_token=config.fault_fail_on_token,
            gguf_types=_gguf_types(self.model_dir, config))
        self.dtype, act_dtype = plan.dtype, plan.act_dtype
        if torch.get_num_threads() != plan.threads:  # this is the compute thread (compute.py)
            torch.set_num_threads(plan.threads)
        # test-only paths bound here, not looked up every step
        self._passes = self._zero_cost_passes if plan.zero_cost_steps else self._model_passes
        self.after_step = fault_injection.after_step_hook(plan.fault_stop_after_steps)
        self.before_step = fault_injection.before_step_hook(plan.fault_fail_on_token)
        # the family module that serves this checkpoint (model/registry.py)
        family = FAMILIES[cfg.family]
        module = family.module()
        if config.load_format == "dummy" and not family.c_kernels:
            raise ValueError(f"--load-format dummy makes the llama family's weights only; "
                             f"model family {cfg.family!r} needs its checkpoint")
        with torch.inference_mode():
            load_started = time.perf_counter()
            if config.load_format == "dummy":  # never split: refused with tensor parallelism
                weights = dummy_weights(cfg, act_dtype, self.device, seed=config.seed)
            elif plan.weights == "gguf_quantized":  # a GGUF's blocks as they are
                weights = load_quantized_weights(self.model_dir, cfg, module,
                                                 plan.quant_activations)
            else:
                weights = module.load_weights(self.model_dir, cfg, act_dtype, self.device,
                                              self.plan, matmul_dtype=self.dtype)
            if family.c_kernels:  # CPU: prepacked, bf16 for the matmuls only, the kernels' copies
                weights = prepare_weights(weights, plan)
            self.weight_bytes = weight_bytes(weights)
            if plan.weights == "gguf_quantized":
                log.info("gguf_quantized_weights", types=held_types(weights),
                         activations=plan.quant_activations,
                         int8_loop=quant_weights.load().packed_loop
                         if plan.quant_activations == "int8" else None,
                         weight_mib=round(self.weight_bytes / 2**20, 1),
                         load_s=round(time.perf_counter() - load_started, 2),
                         path="quantized: blocks held as in the file, dequantized in the matmul"
                         if plan.quant_activations == "float32" else "quantized: blocks "
                         "repacked at load, activations rounded to int8 in the matmul")
            self.model = module.Model(self.local_config, weights, select_backend(plan),
                                      max_positions=self.max_model_len, plan=plan, tp=self.tp)
            # speculative decoding: the proposer, and the draft model it may run
            self.speculator = build_speculator(
                config.speculative_config, config=config, device=self.device, plan=plan,
                model_cfg=cfg, local_cfg=self.local_config, weights=weights,
                max_model_len=self.max_model_len, block_size=self.block_size, tp=self.tp,
                first=self.plan.first)
            # the window the scheduler frees blocks behind: not with a draft model's
            # KV beside ours in the same blocks (its attention is not windowed alike)
            self.sliding_window = kv_window(cfg, self.max_model_len) \
                if self.speculator is None or not self.speculator.kv_bytes_per_block(1) else 0
            # positions a request may step back: the draft slots a step may reject
            self._lookback = 0 if self.speculator is None \
                else self.speculator.spec.num_speculative_tokens
            if self.tp is not None:  # the CUDA profiling pass runs collectives
                self.tp.wait_for_all("loaded")
            self.num_kv_blocks = self._measure_num_blocks()
            if self.tp is not None:  # one block id means one block on every rank
                self.num_kv_blocks = self.tp.min_int(self.num_kv_blocks)
            # zero-cost steps never touch the cache: the block count is all the stack sees
            self.kv_caches = [] if config.zero_cost_steps else \
                self.model.allocate_kv_caches(self.num_kv_blocks, self.block_size)
            if self.speculator is not None:
                self.speculator.allocate_kv(self.num_kv_blocks, self.block_size)
            # last sampled token per request row, on the device (see module docstring)
            self.last_sampled = torch.zeros(config.max_num_seqs, dtype=torch.long,
                                            device=self.device)
        self.requests: dict[str, WorkerRequest] = {}
        self.free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        # structured outputs: rank 0 samples, so it alone compiles and holds matchers
        self.grammars = GrammarRuntime(
            str(self.model_dir), cfg.vocab_size, list(cfg.eos_token_ids),
            config.structured_outputs_compile_timeout_s) if self.plan.first else None
        self._mask_s = 0.0  # this step's, for StepTimings.mask_ms
        # a routed-experts model: how many experts, top-k, and which ones this rank holds
        moe = {} if cfg.moe is None else {
            "num_experts": cfg.moe.num_experts, "experts_top_k": cfg.moe.top_k,
            "experts_held": f"{self.plan.experts[0]}-{self.plan.experts[1] - 1}"}
        log.info("compute_plan", rank=self.plan.rank, **plan.log_fields(),
                 weight_mib=round(self.weight_bytes / 2**20, 1),
                 cpu_bf16=native_bf16() or "none", **moe)

    def model_info(self) -> ModelInfo:
        cfg = self.model_config
        return ModelInfo(
            model_name=self.config.served_model_name or Path(self.model_dir).name,
            vocab_size=cfg.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=list(cfg.eos_token_ids), num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            compute_plan=self.compute_plan.summary(),
            speculative_config="" if self.speculator is None else self.speculator.summary(),
            model_path=str(self.model_dir), sliding_window=self.sliding_window,
            long_prompt_rope_from=cfg.long_from or 0)

    # ------------------------------------------------------------------ a step

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, on_prepared=None) -> ModelRunnerOutput:
        """Run one step. on_prepared(), if given, is called once the step's inputs are
        built, before the forward pass (the Step stream sends the previous result then)."""
        start_unix, t0 = time.time(), time.perf_counter()
        if step.reset_requests:  # after a failed step: the scheduler resends them whole
            self.drop_requests()
        check_step(step, self.requests, vocab_size=self.model_config.vocab_size,
                   max_model_len=self.max_model_len, num_blocks=self.num_kv_blocks,
                   block_size=self.block_size, sliding_window=self.sliding_window,
                   lookback=self._lookback)  # raises before anything changes
        self._apply_increments(step)
        order = list(step.num_scheduled_tokens)
        out = ModelRunnerOutput(step_id=step.step_id, req_ids=order)
        self._mask_s = 0.0
        if self.grammars is not None:  # before the step: compiles overlap its passes
            self.grammars.announce(step.grammar_compiles)
        states = [self.requests[r] for r in order]
        out.sampled_token_ids = [[] for _ in order]
        out.logprobs = [None if s.params.logprobs is None else [] for s in states]
        # A request that stopped here (a stop token, possibly mid-way through a
        # multi-step) was finished by the scheduler on that token; a step already
        # scheduled behind it skips the request: no tokens, nothing computed.
        live = [i for i, state in enumerate(states) if not state.stopped]
        self.before_step(step.step_id, [states[i] for i in live],
                         [step.num_scheduled_tokens[order[i]] for i in live])
        if not live:
            self._report_grammars(out, hold=not order)
            out.timings = StepTimings(prepare_ms=_ms(t0), start_unix_s=start_unix,
                                      end_unix_s=time.time())
            return out
        out = self._passes(step, order, states, live, out, t0, start_unix, on_prepared)
        self._report_grammars(out)
        out.timings.mask_ms = self._mask_s * 1e3
        return out

    def drop_requests(self) -> int:
        """Forget every request (their rows free): after a failed step their state is
        not to be trusted, and the scheduler resends them whole. Returns how many."""
        held = len(self.requests)
        self.free_rows.extend(state.row for state in self.requests.values())
        self.requests.clear()
        return held

    def _report_grammars(self, out: ModelRunnerOutput, hold: bool = False) -> None:
        """Name the announced grammars that compiled (or failed) since the last step;
        an empty step is the scheduler's poll and is held briefly (grammar.py)."""
        if self.grammars is not None:
            out.grammars_ready, out.grammar_errors = self.grammars.take_done(hold)

    def _zero_cost_passes(self, step, order, states, live, out, t0, start_unix,
                          on_prepared) -> ModelRunnerOutput:
        return zero_cost_step(out, states, live, [step.num_scheduled_tokens[r] for r in order],
                              self.model_config.vocab_size, self._eos, t0, start_unix,
                              step.num_steps)

    def _model_passes(self, step, order, states, live, out, t0, start_unix,
                      on_prepared) -> ModelRunnerOutput:
        """The step's forward passes (one, or num_steps of a multi-step decode)."""
        running = [states[i] for i in live]
        num = [step.num_scheduled_tokens[order[i]] for i in live]
        verify, draft_s = None, 0.0
        if step.num_draft_slots and self.speculator is not None:
            if on_prepared is not None:  # proposing may run a draft model: answer first
                on_prepared()
                on_prepared = None
            slots = [step.num_draft_slots.get(order[i], 0) for i in live]
            t_draft = time.perf_counter()
            verify = self.speculator.draft(running, slots, self.kv_caches, step.step_id)
            draft_s = time.perf_counter() - t_draft
            num = [n - d + len(dr) for n, d, dr in zip(num, slots, verify.drafts)]
            out.num_draft_tokens = [0] * len(order)
            for i, dr in zip(live, verify.drafts):
                out.num_draft_tokens[i] = len(dr)
        inputs = self._prepare_inputs(running, num, None if verify is None else verify.drafts)
        t1 = time.perf_counter()
        if on_prepared is not None:
            on_prepared()
        prepare_s, forward_s, sample_s = t1 - t0 - draft_s, 0.0, 0.0
        passes, num_tokens = 0, 0
        # A multi-step decode (num_steps > 1, every request one token that samples; the
        # step check made sure) is that many passes, each fed the tokens of the last;
        # a request that stops sits out the rest, and when all have stopped it ends.
        for k in range(step.num_steps):
            if k:
                live = [i for i in live if not states[i].stopped]
                if not live:
                    break
                t1 = time.perf_counter()
                running = [states[i] for i in live]
                inputs = self._prepare_inputs(running, [1] * len(live))
                prepare_s += time.perf_counter() - t1
            t2 = time.perf_counter()
            pass_forward_s = self._forward_and_sample(running, live, inputs, out, verify)
            forward_s += pass_forward_s
            sample_s += time.perf_counter() - t2 - pass_forward_s
            passes += 1
            num_tokens += sum(inputs.num_scheduled)
        out.timings = StepTimings(prepare_ms=prepare_s * 1e3, forward_ms=forward_s * 1e3,
                                  sample_ms=sample_s * 1e3, start_unix_s=start_unix,
                                  end_unix_s=time.time(), num_forward_passes=passes,
                                  num_tokens=num_tokens, draft_ms=draft_s * 1e3)
        return out

    def _forward_and_sample(self, states: list[WorkerRequest], slots: list[int], inputs,
                            out, verify: VerifyPass | None = None) -> float:
        """One forward pass over the prepared inputs of `states` (whose places in
        `out` are `slots`), its rows sampled and committed (`_commit`). verify: the
        drafts of a verify pass (speculative decoding). Returns the forward pass's seconds."""
        rows = [states[i] for i in inputs.sample_rows] if verify is None else \
            verify.rows(states, inputs.sample_rows)
        t0 = time.perf_counter()
        positions = inputs.positions
        if self.model_config.long_from is not None:  # longrope: a long prompt's own rows
            positions = longrope_rows(positions, [s.num_prompt_tokens for s in states],
                                      inputs.num_scheduled, self.model_config.long_from,
                                      self.max_model_len)
        logits = self.model.forward(inputs.input_ids, positions, self.kv_caches,
                                    inputs.meta, inputs.logits_indices,
                                    argmax_only=_argmax_only(
                                        rows, self.compute_plan.logits_max_rows))
        self._sync()
        forward_s = time.perf_counter() - t0
        tokens, token_list, logprobs = self._sample(logits, rows)
        for state, n in zip(states, inputs.num_scheduled):
            state.num_computed_tokens += n
        self._commit(states, slots, inputs, tokens, token_list, logprobs, out, verify)
        return forward_s

    def _commit(self, states: list[WorkerRequest], slots: list[int], inputs,
                tokens: torch.Tensor, token_list: list[int], logprobs: list, out,
                verify: VerifyPass | None) -> None:
        """The one commit of sampled tokens. Per sampling request, its rows' samples up
        to and including the first that differs from its drafts (the one sample, with
        none; how many the verify pass accepted: worker_svc/spec/verify.py) go through
        the stop rule (a stop among them ends the answer there) into its state and
        `out`; the last becomes its next input, on the device."""
        last, at = [], 0
        for i, n_rows in zip(inputs.sample_rows, inputs.num_logits):
            state, sampled = states[i], token_list[at:at + n_rows]
            a = 0 if verify is None else verify.accept(i, state, sampled)
            slot = slots[i]
            for token, lp in zip(sampled[:a + 1], logprobs[at:at + a + 1]):
                state.record_sampled(token, self._eos)
                out.sampled_token_ids[slot].append(token)
                if lp is not None:
                    out.logprobs[slot].extend(lp)
                if state.stopped:
                    break
            last.append(sampled[a])
            at += n_rows
        if last:
            row_ids = torch.tensor([states[i].row for i in inputs.sample_rows], device=self.device)
            # one row each: the sampled tensor already holds the last tokens, on the device
            self.last_sampled.index_copy_(0, row_ids, tokens if at == len(last) else
                                          torch.tensor(last, device=self.device))

    def _sample(self, logits: torch.Tensor | None, samplers: list[WorkerRequest]):
        """Rank 0 samples from the gathered logits and sends the tokens to the other
        ranks, which need them as the next step's inputs (and to re-prefill a
        preempted request); only rank 0 reports logprobs."""
        if samplers and self.grammars is not None:  # rank 0: before everything, as vLLM
            self._mask_s += apply_masks(logits, samplers, self.model_config.eos_token_ids)
        if self.tp is None:
            return sample(logits, samplers, self.model_config.eos_token_ids, self.generator)
        if not samplers:  # a step of prefill chunks only: every rank agrees, nothing to send
            return torch.empty(0, dtype=torch.long, device=self.device), [], []
        if self.plan.first:
            tokens, token_list, logprobs = sample(logits, samplers,
                                                  self.model_config.eos_token_ids,
                                                  self.generator)
            self.tp.broadcast_from_first(tokens)
            return tokens, token_list, logprobs
        tokens = torch.empty(len(samplers), dtype=torch.long, device=self.device)
        self.tp.broadcast_from_first(tokens)
        return tokens, tokens.tolist(), [None] * len(samplers)

    def _apply_increments(self, step: SchedulerOutput) -> None:
        for req_id in step.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.free_rows.append(state.row)
        for req_id in step.preempted_req_ids:
            if req_id in self.requests:  # tokens stay; the blocks are gone
                self.requests[req_id].block_ids = []
        for new in step.scheduled_new_reqs:
            self.requests[new.req_id] = self._new_state(new)
        cached = step.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            if cached.resumed_from_preemption[i]:  # recomputed from the scheduler's count
                state.block_ids = list(cached.new_block_ids[i])
                state.num_computed_tokens = cached.num_computed_tokens[i]
                if self.speculator is not None:
                    self.speculator.forget(state)
            else:  # runs from its own count (step_check.own_computed checked the sent one)
                state.block_ids.extend(cached.new_block_ids[i])

    def _new_state(self, new) -> WorkerRequest:
        params = new.sampling_params
        if not self.free_rows:  # more requests held (running + preempted) than rows
            self._grow_rows()
        output = new.output_token_ids  # non-empty: resent after a worker was lost
        state = WorkerRequest(req_id=new.req_id, token_ids=[*new.prompt_token_ids, *output],
                             num_prompt_tokens=len(new.prompt_token_ids),
                             block_ids=list(new.block_ids),
                             num_computed_tokens=new.num_computed_tokens, params=params,
                             row=self.free_rows.pop())
        if output:  # inputs read a request's last sampled token from this row
            self.last_sampled[state.row] = output[-1]
        if params.structured_output is not None and self.grammars is not None:
            # its output so far: a continuation's prompt tail, then what a resend brings
            replay = state.token_ids[state.num_prompt_tokens - params.num_output_prefix_tokens:]
            state.grammar = self.grammars.start(params, replay)
        if state.has_penalties:
            vocab = self.model_config.vocab_size
            state.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            state.prompt_mask[torch.tensor(new.prompt_token_ids, device=self.device)] = True
            state.output_counts = torch.zeros(vocab, dtype=torch.long, device=self.device)
            # earlier output: resent after a worker loss, and a continuation's prompt tail
            earlier = state.token_ids[state.num_prompt_tokens - params.num_output_prefix_tokens:]
            if earlier:
                state.output_counts.index_add_(
                    0, torch.tensor(earlier, device=self.device),
                    torch.ones(len(earlier), dtype=torch.long, device=self.device))
        return state

    def _grow_rows(self) -> None:
        old = self.last_sampled.shape[0]
        self.last_sampled = torch.cat([self.last_sampled, torch.zeros_like(self.last_sampled)])
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _prepare_inputs(self, states: list[WorkerRequest], num_scheduled: list[int],
                        drafts=None):
        return prepare_inputs(states, num_scheduled, self.block_size, self.device,
                              self.last_sampled, drafts)

    # ------------------------------------------------------------------ start-up

    def _measure_num_blocks(self) -> int:
        config = self.config
        per_block = bytes_per_block(self.local_config, self.block_size, self.model.dtype)
        if self.speculator is not None:  # a separate draft model's KV shares the blocks
            per_block += self.speculator.kv_bytes_per_block(self.block_size)
        # one request's most blocks at once: all of max_model_len, or with a window
        # (whose blocks behind it the scheduler frees) the window and one chunk
        blocks_per_seq = max_blocks_per_request(
            self.max_model_len, self.block_size, self.sliding_window,
            self.max_num_batched_tokens, self._lookback)
        if config.num_gpu_blocks_override is not None:
            num_blocks = config.num_gpu_blocks_override
        elif self.device.type == "cuda":
            self._profile_run()
            num_blocks = cuda_num_blocks(self.device, config.gpu_memory_utilization, per_block)
        else:
            num_blocks = min(cpu_num_blocks(config.kv_cache_memory, per_block),
                             usable_blocks(config.max_num_seqs, self.max_model_len,
                                           self.block_size))
        if num_blocks - 1 < blocks_per_seq:
            more = ("--num-gpu-blocks-override" if config.num_gpu_blocks_override is not None
                    else "--gpu-memory-utilization" if self.device.type == "cuda"
                    else "--kv-cache-memory")  # the flag that sized this pool
            raise ValueError(
                f"the KV cache holds {max(num_blocks - 1, 0) * self.block_size} tokens "
                f"({num_blocks} blocks of {self.block_size}, block 0 reserved), less than "
                f"one sequence of --max-model-len {self.max_model_len}" + (
                    f" needs at once ({blocks_per_seq} blocks: its "
                    f"{self.sliding_window}-token window and a chunk)"
                    if self.sliding_window else "")
                + f": lower --max-model-len or raise {more}")
        self.kv_accounting = KvAccounting(
            weight_bytes=self.weight_bytes, kv_bytes_per_token=per_block // self.block_size,
            num_blocks=num_blocks, block_size=self.block_size,
            max_model_len=self.max_model_len)
        log.info(self.kv_accounting.describe(), rank=self.plan.rank,
                 **self.kv_accounting.fields())
        return num_blocks

    def _profile_run(self) -> None:
        """A forward pass at the largest step (max_num_batched_tokens tokens, logits
        for max_num_seqs rows), so the peak activation memory is measured."""
        num_tokens = min(self.max_num_batched_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size) + 1
        caches = self.model.allocate_kv_caches(num_blocks, self.block_size)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=dev) + self.block_size,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            block_table=torch.arange(1, num_blocks, dtype=torch.int32, device=dev)[None],
            max_query_len=num_tokens, max_seq_len=num_tokens)
        rows = torch.arange(min(self.config.max_num_seqs, num_tokens), device=dev)
        logits = self.model.forward(torch.zeros(num_tokens, dtype=torch.long, device=dev),
                                    torch.arange(num_tokens, device=dev), caches, meta, rows)
        if logits is not None:  # None on tensor-parallel ranks other than 0
            logits.softmax(dim=-1)
        torch.cuda.synchronize(dev)
        del caches, logits

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


BIG_GPU_BYTES = 70 << 30


def default_max_num_batched_tokens(device: torch.device) -> int:
    """docs/scheduling.md's default budget: 8,192 on GPUs with 70 GiB or more, else 2,048."""
    if device.type == "cuda" and \
            torch.cuda.get_device_properties(device).total_memory >= BIG_GPU_BYTES:
        return 8192
    return 2048


def _gguf_types(model_dir: Path, config: WorkerConfig) -> dict[str, int] | None:
    """A GGUF's matmul tensor types (bytes of each), None for other checkpoints."""
    source = gguf_source(model_dir) if config.load_format != "dummy" else None
    return None if source is None else matmul_types(source)


def _resolve_device(name: str, rank: int = 0, tp_size: int = 1) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but no CUDA device is available")
    if device.type == "cuda" and device.index is None and tp_size > 1:
        # ranks on one host take one GPU each; one GPU per container sees only cuda:0
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return device


def _join_group(plan, config: WorkerConfig, device: torch.device):
    from worker_svc.parallel.group import TensorParallelGroup
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return TensorParallelGroup(plan, config.master_addr, config.master_port,
                               config.distributed_timeout, device,
                               config.distributed_backend)


def _argmax_only(samplers: list[WorkerRequest], max_rows: int) -> bool:
    """A small step (only those screen) whose every sampling row is greedy with nothing
    that changes its logits: the sampler takes only each row's argmax
    (small_linear.screened_argmax_logits)."""
    return 0 < len(samplers) <= max_rows and all(
        s.params.greedy and s.params.logprobs is None and not s.params.logit_bias
        and not s.has_penalties and s.num_output_tokens >= s.params.min_tokens
        and s.grammar is None
        for s in samplers)


def _resolve_max_model_len(requested: int | None, cfg) -> int:
    # the RoPE's positions: max_position_embeddings, or YaRN's scaled length (config.py);
    # a sliding window does not cap it: attention applies the window (layer_windows)
    limit = cfg.max_context or cfg.max_position_embeddings
    if requested is None:
        return limit
    if not 0 < requested <= limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] for this model "
                         f"(max_position_embeddings, YaRN-scaled where configured), "
                         f"got {requested}")
    return requested
