"""A worker stand-in for speculative decoding, and the checks of docs/spec_decode.md.

`SpecWorker` is a worker as the design asks for one: it holds every request's tokens
(those it sampled included) and its own count of positions whose KV is committed;
it fills each step's draft slots with its own proposals (a random mix of the model's
true next tokens and wrong ones, sometimes fewer than the slots), runs its "model"
on the drafted positions, accepts while a draft equals the model's token and
answers with 1 + accepted tokens (greedy verification), under the services' stop
rule. Its model's next token is a function of the whole prefix, so a token computed
at a wrong position or after a wrong prefix changes the stream. Like KVWorker it keeps
a paged cache: a slot written holds (cache salt, the input tokens up to it), drafts
included, so a rejected draft leaves KV that no committed prefix matches.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

from scheduler_svc.core import Scheduler
from scheduler_svc.core.request import RequestStatus
from shared.stop_rule import is_stop, stop_ids
from shared.token_checksum import token_checksum
from shared.types import ModelRunnerOutput, SamplingParams, SchedulerOutput
from tests.scheduler.helpers import EOS


def prefix_model(eos_every: int = 1000) -> Callable[[tuple[int, ...] | list[int]], int]:
    """A deterministic "model": the next token is a hash of the last three tokens and
    the length, so it depends on the prefix, not only on the position."""

    def next_token(prefix) -> int:
        h = zlib.crc32(f"{len(prefix)}:{tuple(prefix[-3:])}".encode())
        return EOS if h % eos_every == 0 else 10 + h % 40

    return next_token


def expected_stream(model, prompt: list[int], params: SamplingParams,
                    max_model_len: int) -> list[int]:
    """What decoding without any scheduler gives: one token at a time, the stop rule."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        token = model(tokens)
        tokens.append(token)
        out.append(token)
        if is_stop(token, len(out), stop_ids(params, {EOS}), params.min_tokens):
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out


class SpecWorker:
    def __init__(self, model, block_size: int, max_model_len: int, *, seed: int = 0,
                 p_good: float = 0.7, p_short: float = 0.2,
                 salts: dict[str, str | None] | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.rng = random.Random(seed)
        self.p_good = p_good  # a proposal is the model's own next token
        self.p_short = p_short  # fewer proposals than slots (an n-gram without a match)
        self.salts = salts if salts is not None else {}
        self.tokens: dict[str, list[int]] = {}
        self.params: dict[str, tuple[SamplingParams, int]] = {}
        self.stopped: set[str] = set()
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}  # positions whose KV holds committed tokens
        self.kv: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}
        self.true_after: dict[int, dict[str, int]] = {}  # step -> req -> computed after
        self.last: dict[str, tuple[int, int]] = {}  # req -> (last step, slots it rejected)
        self.proposed = 0
        self._proposed_now = 0  # drafts of the request being run, for its answer
        self.accepted = 0

    # ---------------------------------------------------------------- one step

    def execute(self, so: SchedulerOutput, slots: dict[str, int]) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            for table in (self.tokens, self.params, self.tables, self.computed, self.last):
                table.pop(req_id, None)
            self.stopped.discard(req_id)
        for req_id in so.preempted_req_ids:
            self.tables[req_id] = []  # token ids are kept across a preemption
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.params[new.req_id] = (new.sampling_params, len(new.prompt_token_ids))
            self.tables[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, resumed, blocks, sent in zip(cached.req_ids, cached.resumed_from_preemption,
                                                 cached.new_block_ids, cached.num_computed_tokens):
            table = self.tables[req_id]
            if resumed:
                tokens = self.tokens[req_id]
                assert cached.resumed_token_checks[req_id] == (len(tokens), token_checksum(tokens))
                table.clear()
                self.computed[req_id] = sent
            elif req_id not in self.stopped:  # a stopped one is skipped: any count
                self._check_sent(so.step_id, req_id, sent)
            table.extend(blocks)
        out = ModelRunnerOutput(step_id=so.step_id)
        after = self.true_after[so.step_id] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            self._proposed_now = 0
            sampled = [] if req_id in self.stopped else \
                self._run(so, req_id, n, slots.get(req_id, 0))
            after[req_id] = self.computed[req_id]
            out.req_ids.append(req_id)
            out.sampled_token_ids.append(sampled)
            out.num_draft_tokens.append(self._proposed_now)  # as the real worker reports
        return out

    def _check_sent(self, step_id: int, req_id: str, sent: int) -> None:
        """The scheduler's count for a cached request is ours, or, when it scheduled
        this step before applying the step just before (async), ours plus the slots we
        rejected there: it counts a step in flight as if every slot were accepted."""
        own = self.computed[req_id]
        last_step, rejected = self.last.get(req_id, (-1, 0))
        allowed = {own, own + rejected} if last_step == step_id - 1 else {own}
        assert sent in allowed, (req_id, sent, own, self.last.get(req_id))

    def _run(self, so: SchedulerOutput, req_id: str, n: int, d: int) -> list[int]:
        tokens = self.tokens[req_id]
        start = self.computed[req_id]
        base = n - d
        assert start + base <= len(tokens), (req_id, start, base, len(tokens))
        if start + base < len(tokens):  # a prefill chunk that does not reach the end
            assert d == 0
            self._write(req_id, tokens, start, n)
            self.computed[req_id] = start + n
            return []
        if so.num_steps > 1:
            assert d == 0
            return self._multi_step(req_id, start, so.num_steps)
        drafts = self._propose(tokens, d)
        seq = tokens + drafts
        self._write(req_id, seq, start, base + len(drafts))
        targets = [self.model(seq[:len(tokens) + i]) for i in range(len(drafts) + 1)]
        a = 0
        while a < len(drafts) and drafts[a] == targets[a]:
            a += 1
        sampled = self._commit(req_id, targets[:a + 1])
        self.proposed += len(drafts)
        self._proposed_now = len(drafts)
        self.accepted += len(sampled) - 1  # a stop among them ends the answer there
        self.computed[req_id] = start + base + a
        self.last[req_id] = (so.step_id, d - a)
        return sampled

    def _propose(self, tokens: list[int], d: int) -> list[int]:
        if d and self.rng.random() < self.p_short:
            d = self.rng.randrange(d)
        drafts: list[int] = []
        for _ in range(d):
            right = self.model(tokens + drafts)
            drafts.append(right if self.rng.random() < self.p_good
                          else 10 + (right - 10 + 1 + self.rng.randrange(39)) % 40)
        return drafts

    def _multi_step(self, req_id: str, start: int, steps: int) -> list[int]:
        tokens = self.tokens[req_id]
        sampled = []
        for k in range(steps):
            sampled += self._commit(req_id, [self.model(tokens)])
            self._write(req_id, tokens, start + k, 1)
            if req_id in self.stopped:
                break
        self.computed[req_id] = start + len(sampled)
        return sampled

    def _commit(self, req_id: str, emitted: list[int]) -> list[int]:
        """Append tokens under the services' stop rule: the first stop ends them."""
        params, num_prompt = self.params[req_id]
        tokens = self.tokens[req_id]
        out = []
        for token in emitted:
            tokens.append(token)
            out.append(token)
            if is_stop(token, len(tokens) - num_prompt, stop_ids(params, {EOS}),
                       params.min_tokens):
                self.stopped.add(req_id)
                break
        return out

    def _write(self, req_id: str, seq: list[int], start: int, count: int) -> None:
        table = self.tables[req_id]
        size = self.block_size
        for pos in range(start, start + count):
            assert pos <= self.max_model_len - 2, f"{req_id}: position {pos} past max_model_len"
            assert pos // size < len(table), f"{req_id}: position {pos} has no block"
            self.kv[(table[pos // size], pos % size)] = (self.salts.get(req_id),
                                                         tuple(seq[:pos + 1]))


# -------------------------------------------------------------------- the checks

def check_spec_counters(sched: Scheduler, base: dict[str, int],
                        steps: dict[int, SchedulerOutput]) -> None:
    """After every step: computed tokens = committed + placeholders, exactly. For each
    running request, num_computed_tokens is `base` (the positions whose KV holds
    committed tokens as of the last answer applied, which the worker reports) plus the
    work of its steps in flight; its placeholders are what those steps may sample;
    the committed positions never reach its last token; nothing reaches past
    max_model_len or max_tokens even if every slot is accepted."""
    cfg = sched.config
    for req_id, request in sched.requests.items():
        num_tokens = len(request.all_token_ids)
        assert num_tokens <= cfg.max_model_len
        assert num_tokens + request.num_output_placeholders <= request.max_num_tokens
        if request.status is not RequestStatus.RUNNING:
            assert request.num_computed_tokens == request.num_output_placeholders == 0
            continue
        work = placeholders = 0
        for step_id, step in sched.in_flight.items():
            entry = step.get(req_id)
            if entry is None or entry.num_preemptions != request.num_preemptions:
                continue
            so = steps[step_id]
            work += so.num_steps if so.num_steps > 1 else so.num_scheduled_tokens[req_id]
            if entry.samples:
                placeholders += entry.max_sampled - (0 if cfg.async_scheduling else 1)
        assert request.num_output_placeholders == placeholders, request
        assert request.num_computed_tokens == base[req_id] + work, (request, base[req_id])
        assert base[req_id] <= num_tokens - 1, request
        assert request.num_computed_tokens <= cfg.max_model_len - 1, request
