"""The scheduler: decides, each step, how many tokens of which requests to compute.

Rules (vLLM V1 semantics) and where we deviate: docs/scheduling.md.
"""

from __future__ import annotations

from scheduler_svc.core.block_hash import BlockHasher
from scheduler_svc.core.block_pool import KVBlock
from scheduler_svc.core.config import ConfigError, SchedulerConfig
from scheduler_svc.core.grammar_wait import GrammarWait
from scheduler_svc.core.in_flight import (MAX_STEPS_IN_FLIGHT, InFlight, WorkerOutputError,
                                          both_sides)
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.queues import make_queue
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.spec_slots import (NO_DRAFTS, add_draft_slots, committed_kv_end,
                                           count_scheduled, roll_back_step)
from scheduler_svc.core.stats import SchedulerStats
from scheduler_svc.core.step_failure import StepFailures
from shared.kv_window import max_blocks_per_request
from shared.request_limits import token_ids_problem
from shared.stop_rule import finish_reason, first_stop
from shared.token_checksum import token_checksum
from shared.types import (
    FinishReason,
    InvalidRequestError,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
)


def pool_refusal(config: SchedulerConfig, num_blocks: int) -> str | None:
    """Why a KV pool of num_blocks cannot serve this configuration, or None. The
    longest request keeps KV for max_model_len - 1 tokens (its last token is sampled,
    never computed), or with a sliding window its window and one chunk; if that
    cannot fit, it could never finish."""
    if num_blocks < 2:
        return f"the KV pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}"
    spec = config.speculative_config
    lookback = spec.num_speculative_tokens if spec else 0
    need = max_blocks_per_request(config.max_model_len, config.block_size,
                                  config.sliding_window, config.max_num_batched_tokens,
                                  lookback)
    if need > num_blocks - 1:
        return (f"max_model_len {config.max_model_len} needs {need} KV blocks of "
                f"{config.block_size} tokens" + (
                    f" (its {config.sliding_window}-token window and a chunk of "
                    f"{config.max_num_batched_tokens})" if need < -(-(
                        config.max_model_len - 1) // config.block_size) else "")
                + f", but the pool has only {num_blocks - 1}; lower max_model_len or give "
                f"the workers more memory")
    return None


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int) -> None:
        config.validate()
        refusal = pool_refusal(config, num_blocks)
        if refusal is not None:
            raise ConfigError(refusal)
        self.config = config
        spec = config.speculative_config
        lookback = spec.num_speculative_tokens if spec else 0  # rejected draft slots
        self.kv = KVCacheManager(num_blocks, config.block_size, config.max_model_len,
                                 config.enable_prefix_caching, config.sliding_window,
                                 lookback)
        self.hasher = BlockHasher(config.block_size, config.hash_seed,
                                  config.long_prompt_rope_from) \
            if config.enable_prefix_caching else None
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []  # in admission order
        self.finished_req_ids: set[str] = set()  # reported in the next SchedulerOutput
        # step id -> {req_id: InFlight}: what each step computes, committed on its output
        self.in_flight: dict[int, dict[str, InFlight]] = {}
        self.next_step_id = 0
        self._stats = SchedulerStats(num_total_blocks=num_blocks)
        spec = config.speculative_config  # accepted drafts by position, vLLM's per_pos
        self._accepted_per_pos = [0] * (spec.num_speculative_tokens if spec else 0)
        self.grammar = GrammarWait()  # requests deferred while their grammar compiles
        self.failures = StepFailures()  # failed steps: retry, isolate, fail the culprit
        self.reset_requests = False  # the next step tells the workers to drop every request

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a request the door (Engine.check, scheduler_svc/engine.py) accepted;
        a request id or state this scheduler already holds raises InvalidRequestError
        and queues nothing."""
        if request.req_id in self.requests:
            raise InvalidRequestError(f"request id {request.req_id!r} is already in use")
        limit = self.config.max_model_len
        # validated at the door; asserted here in O(1) (no vocabulary scan, no params)
        problem = token_ids_problem(request.prompt_token_ids, limit)
        assert problem is None, problem
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise InvalidRequestError(f"request {request.req_id!r} was already scheduled")
        request.max_num_tokens = min(request.max_num_tokens, limit)
        if self.hasher is not None:
            request.block_hasher = self.hasher
            self.hasher(request)
        self.requests[request.req_id] = request
        self.waiting.add(request)
        self.grammar.on_add(request)

    def abort_requests(self, req_ids) -> list[RequestOutput]:
        """Finish the given requests now and free their blocks at once. Returns one
        ABORT output per request that was still unfinished (unknown ids are ignored:
        an abort may race with a normal finish). The ids also appear in the next
        SchedulerOutput.finished_req_ids, so workers drop their state."""
        outputs = []
        removed_running = False
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            removed_running |= request.status is RequestStatus.RUNNING
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(request, []))
        if removed_running:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        # The whole state machine is one comparison: a request needs work while
        # num_computed_tokens < num_tokens + num_output_placeholders, and gets
        # min(gap, limits) tokens. Prefill, chunked prefill, decode and recompute
        # after preemption are all that same rule (docs/scheduling.md, "The gap").
        if len(self.in_flight) >= MAX_STEPS_IN_FLIGHT:
            raise RuntimeError(f"{MAX_STEPS_IN_FLIGHT} steps are already in flight; apply "
                               f"the oldest one's output (update_from_output) first")
        if self.failures.isolating:
            return self._schedule_solo(self.failures.solo())
        cfg = self.config
        threshold = cfg.long_prefill_token_threshold
        # The per-request cap does not apply when only one request is eligible (unless
        # configured to follow vLLM, which always applies it).
        cap = threshold if threshold and (len(self.running) + len(self.waiting) > 1
                                          or not cfg.long_prefill_exempt_lone_request) else 0
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, list[KVBlock]] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []
        budget = self._schedule_running(cfg.max_num_batched_tokens, cap, num_scheduled,
                                        new_blocks_of, scheduled_running, preempted)
        drafts = NO_DRAFTS
        if cfg.speculative_config is not None and scheduled_running and not preempted:
            budget, drafts = add_draft_slots(self, cap, budget, scheduled_running,
                                             num_scheduled, new_blocks_of)
        new_reqs: list[Request] = []
        resumed: list[Request] = []
        if not preempted:
            blocked_by = self._schedule_waiting(budget, cap, num_scheduled, new_reqs, resumed)
        else:  # never evict one request and admit another in the same step
            blocked_by = "preemption" if self.waiting.peek() is not None else None
        steps = 1
        if cfg.num_scheduler_steps > 1 and scheduled_running and not len(self.waiting) \
                and not (new_reqs or resumed or preempted):
            steps = self._multi_steps(scheduled_running, num_scheduled, new_blocks_of)
        return self._emit(new_reqs, resumed, scheduled_running, new_blocks_of,
                          num_scheduled, preempted, blocked_by, steps, drafts)

    def _clamp(self, n: int, cap: int, budget: int, num_computed: int) -> int:
        """The token clamp of both passes: min(gap `n`, the long-prefill cap, the
        budget left, max_model_len - 1 - computed: the last token is sampled, never
        computed)."""
        if cap and n > cap:
            n = cap
        if n > budget:
            n = budget
        room = self.config.max_model_len - 1 - num_computed
        return room if n > room else n

    def _schedule_running(self, budget: int, cap: int, num_scheduled: dict[str, int],
                          new_blocks_of: dict[str, list[KVBlock]],
                          scheduled_running: list[Request], preempted: list[Request]) -> int:
        """Pass 1: RUNNING, in admission order; preempts a victim while blocks do not
        fit. Fills the step's tables; returns the budget left."""
        kv = self.kv
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            n = self._clamp(len(request.all_token_ids) + request.num_output_placeholders
                            - request.num_computed_tokens, cap, budget,
                            request.num_computed_tokens)
            # Async: a request whose in-flight steps reach max_tokens gets no further step.
            if len(request.output_token_ids) + request.num_output_placeholders >= request.max_tokens:
                n = 0
            if n <= 0:
                i += 1
                continue
            while True:
                blocks = kv.allocate_slots(request, n)
                if blocks is not None:
                    break
                victim = self._pick_victim()
                index = running.index(victim) if victim is not running[-1] else len(running) - 1
                del running[index]
                if index < i:  # it sat before us: the current request moved down one
                    i -= 1
                if victim.req_id in num_scheduled:  # already scheduled this step: refund
                    budget += num_scheduled.pop(victim.req_id)
                    del new_blocks_of[victim.req_id]
                    scheduled_running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                break
            num_scheduled[request.req_id] = n
            new_blocks_of[request.req_id] = blocks
            scheduled_running.append(request)
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, cap: int, num_scheduled: dict[str, int],
                          new_reqs: list[Request], resumed: list[Request]) -> str | None:
        """Pass 2: admit from the head of WAITING (never in a step that preempted:
        the caller skips it). Returns why admission stopped, None if WAITING emptied."""
        cfg = self.config
        kv = self.kv
        running = self.running
        waiting = self.waiting
        while (request := waiting.peek()) is not None:
            if len(running) >= cfg.max_num_seqs:
                return "max_num_seqs"
            if budget <= 0:
                return "token_budget"
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            if n > budget and not cfg.enable_chunked_prefill:  # admitted only whole
                return "token_budget"
            n = self._clamp(n, cap, budget, num_hit)
            blocks = kv.allocate_slots(request, n, hit_blocks)
            if blocks is None:  # head-of-line blocking, deliberately: no search further down
                return "kv_cache"
            waiting.pop()
            kv.record_prefix_lookup(request.num_tokens, num_hit)
            if request.status is RequestStatus.PREEMPTED:
                resumed.append(request)
                self._stats.num_waiting_preempted -= 1
                self._stats.num_recomputed_tokens_total += max(0, request.num_lost_tokens - num_hit)
            else:
                new_reqs.append(request)
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            running.append(request)
            num_scheduled[request.req_id] = n
            budget -= n
        return None

    def _schedule_solo(self, solo: Request | None) -> SchedulerOutput:
        """Isolation (core/step_failure.py): a step of one suspect alone, or of nothing
        (its grammar still compiles, or it needs blocks others hold: then the step
        preempts the last other running request, and it is admitted in a later one)."""
        budget = self.config.max_num_batched_tokens
        kv = self.kv
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, list[KVBlock]] = {}
        scheduled_running, preempted, new_reqs, resumed = [], [], [], []
        if solo is None:
            pass
        elif solo.status is RequestStatus.RUNNING:
            n = self._clamp(solo.gap, 0, budget, solo.num_computed_tokens)
            if len(solo.output_token_ids) + solo.num_output_placeholders >= solo.max_tokens:
                n = 0
            blocks = kv.allocate_slots(solo, n) if n > 0 else None
            if blocks is not None:
                num_scheduled[solo.req_id] = n
                new_blocks_of[solo.req_id] = blocks
                scheduled_running.append(solo)
            elif n > 0:
                self._evict_for(solo, preempted)
        else:  # WAITING: every request went back there when the step failed
            hit_blocks, num_hit = kv.get_computed_blocks(solo)
            n = self._clamp(solo.num_tokens - num_hit, 0, budget, num_hit)
            blocks = kv.allocate_slots(solo, n, hit_blocks)
            if blocks is None:
                self._evict_for(solo, preempted)
            else:
                self.waiting.remove(solo)
                kv.record_prefix_lookup(solo.num_tokens, num_hit)
                if solo.status is RequestStatus.PREEMPTED:
                    resumed.append(solo)
                    self._stats.num_waiting_preempted -= 1
                    self._stats.num_recomputed_tokens_total += max(0, solo.num_lost_tokens
                                                                   - num_hit)
                else:
                    new_reqs.append(solo)
                    solo.num_cached_tokens = num_hit
                solo.status = RequestStatus.RUNNING
                solo.num_computed_tokens = num_hit
                self.running.append(solo)
                num_scheduled[solo.req_id] = n
        return self._emit(new_reqs, resumed, scheduled_running, new_blocks_of,
                          num_scheduled, preempted, "isolation")

    def _evict_for(self, solo: Request, preempted: list[Request]) -> None:
        """Free blocks for a suspect running alone: preempt the last other request."""
        others = [r for r in self.running if r is not solo]
        if others:
            self.running.remove(others[-1])
            self._preempt(others[-1])
            preempted.append(others[-1])

    def _multi_steps(self, scheduled: list[Request], num_scheduled: dict[str, int],
                     new_blocks_of: dict[str, list[KVBlock]]) -> int:
        """Multi-step decode (vLLM V0's --num-scheduler-steps; docs/scheduling.md):
        how many forward passes this step runs. Only a step of decodes alone (each
        request one token that samples) and nothing waiting qualifies, so an arrival
        waits at most for the multi-step running (and one queued behind it). Bounded
        by each request's max_tokens and max_model_len, so no pass computes a token
        that cannot be kept for length, and
        by the free blocks: the extra passes' blocks are taken only if all fit, and
        never by preemption. Allocates those blocks; returns 1 if it does not apply."""
        steps = self.config.num_scheduler_steps
        last = self.config.max_model_len - 1
        for request in scheduled:
            computed = request.num_computed_tokens
            if num_scheduled[request.req_id] != 1 or len(request.all_token_ids) \
                    + request.num_output_placeholders - computed != 1:
                return 1  # a prefill chunk, or a token that does not sample
            left = request.max_tokens - len(request.output_token_ids) \
                - request.num_output_placeholders
            steps = min(steps, left, last - computed)
        if steps <= 1:
            return 1
        kv = self.kv
        need = sum(kv.blocks_needed(r, r.num_computed_tokens + steps) for r in scheduled)
        if need > kv.num_free_blocks:
            return 1
        for request in scheduled:
            more = kv.allocate_slots(request, steps)
            if more:
                new_blocks_of[request.req_id] = [*new_blocks_of[request.req_id], *more]
        return steps

    def _emit(self, new_reqs, resumed, scheduled_running, new_blocks_of, num_scheduled,
              preempted, blocked_by, steps: int = 1, drafts=NO_DRAFTS) -> SchedulerOutput:
        kv = self.kv
        out = SchedulerOutput(step_id=self.next_step_id)
        self.next_step_id += 1
        for request in new_reqs:
            out.scheduled_new_reqs.append(NewRequestData(
                req_id=request.req_id, prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_ids=kv.get_block_ids(request.req_id),
                num_computed_tokens=request.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for request in resumed:  # the worker replaces its block table, checks its tokens
            if request.worker_forgot:
                out.scheduled_new_reqs.append(self._resend(request))
                continue
            tokens = request.all_token_ids  # all committed: placeholders went at preemption
            cached.append(request.req_id, True, kv.get_block_ids(request.req_id),
                          request.num_computed_tokens, (len(tokens), token_checksum(tokens)))
        # Column-wise appends inlined: this loop runs once per running request per step.
        ids, flags, block_ids, computed = (cached.req_ids, cached.resumed_from_preemption,
                                           cached.new_block_ids, cached.num_computed_tokens)
        for request in scheduled_running:
            blocks = new_blocks_of[request.req_id]
            ids.append(request.req_id)
            flags.append(False)
            block_ids.append([b.block_id for b in blocks] if blocks else [])
            computed.append(request.num_computed_tokens)

        # Work counts as done when scheduled; a step that reaches the end samples a token.
        # A multi-step decode (steps > 1; every request one sampling token) computes
        # `steps` tokens a request and samples as many: all but the first are
        # placeholders (async: all of them), so the gap stays what one pass leaves.
        async_ = self.config.async_scheduling
        step: dict[str, InFlight] = {}
        total = 0
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            d = drafts.get(req_id, 0) if drafts else 0
            samples = n - d == len(request.all_token_ids) + request.num_output_placeholders \
                - request.num_computed_tokens
            if d:  # draft slots (spec_slots.py): one pass, up to 1 + d tokens
                count_scheduled(request, n, d, async_)
            elif steps == 1:
                request.num_computed_tokens += n
                if samples and async_:
                    request.num_output_placeholders += 1
            else:
                request.num_computed_tokens += steps
                request.num_output_placeholders += steps if async_ else steps - 1
            step[req_id] = InFlight(request, samples, request.num_computed_tokens,
                                    request.num_preemptions, steps + d,
                                    d, request.num_rejected_tokens)
            total += n
        if step:  # an empty step computes nothing: its update may be skipped
            self.in_flight[out.step_id] = step
        out.num_scheduled_tokens = num_scheduled
        out.total_num_scheduled_tokens = total
        out.num_steps = steps
        out.finished_req_ids = self.finished_req_ids
        self.finished_req_ids = set()
        out.preempted_req_ids = {r.req_id for r in preempted}
        out.grammar_compiles = self.grammar.announcements()
        out.num_draft_slots = drafts  # NO_DRAFTS (shared, read-only) when none
        out.reset_requests, self.reset_requests = self.reset_requests, False

        stats = self._stats
        stats.step_num_scheduled_tokens = total
        stats.step_num_scheduled_reqs = len(num_scheduled)
        stats.step_num_preempted = len(preempted)
        stats.step_num_draft_slots = sum(drafts.values())
        stats.admission_blocked_by = blocked_by
        stats.num_steps += 1
        return out

    # ------------------------------------------------------------------ preemption

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            # Least important: largest (priority, arrival); ties go to the latest arrival.
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # FCFS: the most recently admitted

    def _preempt(self, request: Request, kv_pressure: bool = True) -> None:
        """Preemption is recomputation: free the blocks (full ones keep their hashes),
        forget computed work and placeholders, keep the output, go to the FRONT of WAITING.
        An in-flight step may still write the freed blocks; that is safe only because
        workers execute steps strictly in order, so a new owner writes them later."""
        self.kv.free(request)
        stats = self._stats
        request.num_lost_tokens = request.num_computed_tokens
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        if kv_pressure:  # a lost worker is not a capacity signal (requeue_all_for_recompute)
            stats.num_preemptions_total += 1
        stats.num_waiting_preempted += 1
        self.waiting.prepend(request)
        # the warning an operator reads is logged at the edge (scheduler_svc/metrics.py)

    # ------------------------------------------------------------------ worker loss

    def requeue_all_for_recompute(self) -> list[str]:
        """The workers lost every request's state and KV (one died or was replaced):
        preempt everything RUNNING to the front of WAITING in admission order, drop
        in-flight steps with their placeholders and the prefix cache (its blocks'
        contents are gone), and mark every request the workers had seen to be resent
        whole. Generated tokens are kept, so greedy output continues unchanged.
        Returns the ids that were running, in admission order."""
        running, self.running = self.running, []
        for request in reversed(running):  # each goes to the front: the first ends first
            self._preempt(request, kv_pressure=False)
        for request in self.requests.values():
            if request.status is RequestStatus.PREEMPTED:  # now, or by an earlier preemption
                request.worker_forgot = True
        self.in_flight.clear()  # their results will never come
        self.finished_req_ids = set()  # a fresh worker holds none of them
        self.kv.pool.forget_cached()
        self.grammar.requeue_all(self.requests.values())  # their compiled grammars are gone
        return [r.req_id for r in running]

    def resize_kv_pool(self, num_blocks: int) -> None:
        """Workers that came back after a loss with a pool of another size (one sized
        from the memory free at its start: docs/resilience.md): take it, since the
        loss emptied ours (requeue_all_for_recompute). Raises ConfigError if it
        cannot serve the configuration (pool_refusal)."""
        refusal = pool_refusal(self.config, num_blocks)
        if refusal is not None:
            raise ConfigError(refusal)
        self.kv.resize(num_blocks)
        self._stats.num_total_blocks = num_blocks

    def step_failed(self, step_id: int, error: str) -> list[tuple[str, str]]:
        """The workers answered a step with an error (docs/resilience.md): every later
        step in flight is void, every request is recomputed and resent whole (the
        worker drops them at the next step, which says so), and the culprits the
        rules of core/step_failure.py find are failed, their blocks freed.
        Returns (req_id, why) of each request failed."""
        culprits = self.failures.step_failed(self.in_flight.get(step_id, {}), error)
        self.requeue_all_for_recompute()
        self.reset_requests = True
        return self._fail_requests(culprits)

    def worker_lost(self, error: str) -> tuple[list[str], list[tuple[str, str]]]:
        """A worker died (or was replaced): requeue everything for recompute; the steps
        in flight count as one failed step (core/step_failure.py), so a request in
        flight at two losses in a row, alone, is failed. Returns the ids that were
        running and (req_id, why) of each request failed."""
        culprits = self.failures.worker_lost(self.in_flight.values(), error)
        running = self.requeue_all_for_recompute()
        return running, self._fail_requests(culprits)

    def _fail_requests(self, culprits: list[tuple[Request, str]]) -> list[tuple[str, str]]:
        for request, _ in culprits:
            self._finish(request, RequestStatus.FINISHED_ERROR)
        self.finished_req_ids = set()  # requeued: the workers hold none of them
        self.running = [r for r in self.running if not r.is_finished]
        return [(r.req_id, why) for r, why in culprits]

    def _resend(self, request: Request) -> NewRequestData:
        """A re-admitted request the workers do not hold: all of its data as new."""
        request.worker_forgot = False
        return NewRequestData(
            req_id=request.req_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=self.kv.get_block_ids(request.req_id),
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids))

    # ------------------------------------------------------------------ results

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Commit the sampled tokens of one step, check stops, free finished requests.
        Returns one output per request that got new tokens or finished."""
        step_id = model_runner_output.step_id
        step = self.in_flight.get(step_id)
        if scheduler_output.step_id != step_id:
            raise WorkerOutputError(f"worker output is for step {step_id}, "
                                    f"but it was passed with step {scheduler_output.step_id}")
        self._apply_grammar_output(model_runner_output)
        req_ids = model_runner_output.req_ids
        if step is None:
            if not scheduler_output.num_scheduled_tokens and not req_ids \
                    and step_id < self.next_step_id:
                return []  # an empty step: nothing was in flight, nothing to apply
            raise WorkerOutputError(f"step {step_id} is not in flight (unknown or already "
                                    f"applied)")
        sampled_ids = model_runner_output.sampled_token_ids
        if len(req_ids) != len(sampled_ids):
            raise WorkerOutputError("worker output has a different number of request ids "
                                    "and token lists")
        for req_id, sampled in zip(req_ids, sampled_ids):
            entry = step.get(req_id)
            if entry is None:
                raise WorkerOutputError(f"worker output names request {req_id!r}, not in "
                                        f"step {step_id}", {req_id: {"worker": list(sampled)}})
            problem = None
            if sampled and not entry.samples:
                problem = (f"worker sampled for request {req_id!r} in step {step_id}, whose "
                           f"chunk there did not reach the end of its tokens")
            elif len(sampled) > entry.max_sampled or (
                    entry.samples and len(sampled) < entry.max_sampled
                    and not (entry.num_drafts and sampled)  # rejected drafts: shorter
                    and not self._stopped_short(entry.request, sampled)):
                problem = (f"worker sampled {len(sampled)} tokens for request {req_id!r} in "
                           f"step {step_id}, which " + (
                               f"had {entry.num_drafts} draft slot(s)" if entry.num_drafts
                               else f"ran {entry.max_sampled} forward pass(es)"))
            if problem is not None:
                raise WorkerOutputError(problem, {req_id: both_sides(entry, sampled)})
        del self.in_flight[step_id]
        if self.config.speculative_config is not None:
            roll_back_step(self, step, req_ids, sampled_ids,
                           model_runner_output.num_draft_tokens)
        self._commit_kv(step)
        self.failures.step_succeeded(step)

        logprobs = model_runner_output.logprobs
        outputs = []
        any_finished_running = False
        finished_status = RequestStatus.FINISHED_STOPPED
        for k, (req_id, sampled) in enumerate(zip(req_ids, sampled_ids)):
            if not sampled:  # a non-final prefill chunk
                continue
            entry = step[req_id]
            request = entry.request
            # Finished meanwhile (EOS in the previous step, or aborted): the token
            # computed after the end is discarded.
            if request.status >= finished_status:
                continue
            placeholders = request.num_output_placeholders
            if placeholders and not entry.num_drafts:  # 0 if preempted since: dropped
                request.num_output_placeholders = max(0, placeholders - len(sampled))
            new_ids = []
            status = None
            for token_id in sampled:
                request.append_output_token(token_id)
                new_ids.append(token_id)
                if token_id in request.stop_check_ids \
                        or len(request.all_token_ids) >= request.max_num_tokens:
                    status = self._check_stop(request, token_id)
                    if status is not None:
                        break
            if status is not None:
                any_finished_running |= request.status is RequestStatus.RUNNING
                self._finish(request, status)
                new_logprobs = logprobs[k] if k < len(logprobs) and logprobs[k] else []
                outputs.append(self._output(request, new_ids, new_logprobs[:len(new_ids)]))
            else:  # the common case, kept cheap: no finish fields to look up
                new_logprobs = logprobs[k][:len(new_ids)] if k < len(logprobs) and logprobs[k] else []
                outputs.append(RequestOutput(req_id, new_ids, new_logprobs, None, None,
                                             request.num_preemptions, request.num_cached_tokens))
        if any_finished_running:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _apply_grammar_output(self, model_runner_output: ModelRunnerOutput) -> None:
        """Compiled grammars end their requests' deferral (core/grammar_wait.py); a
        grammar the worker could not compile ends its request (the engine reports
        why, from grammar.take_failures())."""
        if model_runner_output.grammars_ready or model_runner_output.grammar_errors:
            for request in self.grammar.on_output(model_runner_output.grammars_ready,
                                                  model_runner_output.grammar_errors):
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _commit_kv(self, step: dict[str, InFlight]) -> None:
        """The step's KV is written: register its newly full blocks in the prefix
        cache, up to the end its committed tokens reach (committed_kv_end: never a
        block holding a rejected draft). Not for requests finished or preempted since
        it was scheduled: their blocks were freed (and may have a new owner)."""
        if self.hasher is None:
            return
        cache = self.kv.cache_computed_blocks
        spec = self.config.speculative_config is not None
        for entry in step.values():
            request = entry.request
            if request.status is RequestStatus.RUNNING \
                    and request.num_preemptions == entry.num_preemptions:
                cache(request, committed_kv_end(request, entry) if spec
                      else entry.num_computed_after)

    @staticmethod
    def _stopped_short(request: Request, sampled: list[int]) -> bool:
        """May the worker answer with fewer tokens than the step's passes? Only for a
        request that stopped (docs/scheduling.md, "Multi-step decode"): one that ended
        before (the worker skips it: any number, none included), or one whose last
        token is its first stop token (the worker ran no pass for it after that)."""
        if request.status >= RequestStatus.FINISHED_STOPPED:
            return True
        j = first_stop(sampled, len(request.output_token_ids), request.stop_check_ids,
                       request.min_tokens)
        return j is not None and j == len(sampled) - 1

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        # The one stop rule of both services (shared/stop_rule.py).
        reason = finish_reason(token_id, len(request.output_token_ids),
                               len(request.all_token_ids), request.stop_check_ids,
                               request.min_tokens, request.max_tokens,
                               self.config.max_model_len)
        if reason is FinishReason.STOP:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        return None if reason is None else RequestStatus.FINISHED_LENGTH

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free its blocks; the caller drops it from RUNNING."""
        if request.status is not RequestStatus.RUNNING:  # in WAITING: dropped lazily
            self.waiting.discard(request)
            if request.status is RequestStatus.PREEMPTED:
                self._stats.num_waiting_preempted -= 1
        request.status = status
        request.num_output_placeholders = 0
        self.kv.free(request)
        self.grammar.on_finish(request)
        self.failures.forget(request)
        del self.requests[request.req_id]
        self.finished_req_ids.add(request.req_id)

    @staticmethod
    def _output(request: Request, new_ids: list[int], new_logprobs=()) -> RequestOutput:
        return RequestOutput(
            req_id=request.req_id, new_token_ids=new_ids, new_logprobs=list(new_logprobs),
            finish_reason=request.finish_reason, stop_token_id=request.stop_token_id,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens)

    # ------------------------------------------------------------------ inspection

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """All blocks, the reserved null block included; fully free = total - 1."""
        return self.kv.pool.num_blocks

    def get_block_ids(self, req_id: str) -> list[int]:
        return self.kv.get_block_ids(req_id)

    def stats(self) -> SchedulerStats:
        s = self._stats
        s.num_running = len(self.running)
        s.num_waiting = len(self.waiting)
        s.kv_usage = self.kv.usage
        s.num_free_blocks = self.kv.num_free_blocks
        s.prefix_cache_queries = self.kv.prefix_queries
        s.prefix_cache_hits = self.kv.prefix_hits
        s.num_window_freed_blocks_total = self.kv.num_window_freed_blocks
        s.num_steps_in_flight = len(self.in_flight)
        s.spec_num_accepted_tokens_per_pos = tuple(self._accepted_per_pos)
        s.num_waiting_not_ready = self.grammar.num_deferred
        return SchedulerStats(**{f: getattr(s, f) for f in SchedulerStats.__slots__})
