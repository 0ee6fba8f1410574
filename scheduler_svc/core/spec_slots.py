"""Draft slots of speculative decoding, in the gap (docs/spec_decode.md).

The scheduler cannot know a step's drafts when it schedules the next one (async
scheduling), so it reserves *slots*: a decoding request gets up to k positions past
its last token, charged to the step's budget and given KV like any token, and the
worker fills them with its own proposals, verifies them and answers with the tokens
it committed (1 + accepted drafts). The slots are placeholders until the answer; the
rejected ones are taken back then. One function per rule, each called from one place
in scheduler.py:

- `add_draft_slots`: which requests get slots and how many (the budget clamp, the KV
  allocation): after pass 1, never in a step that preempted, never by preemption;
- `count_scheduled`: what scheduling them adds to the request's counters;
- `roll_back` (per request; `roll_back_step` over an answer, with the acceptance
  counters): what the answer takes back;
- `committed_kv_end`: how far a committed step's KV holds committed tokens, the end
  of what the prefix cache may register.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.core.block_pool import KVBlock
from scheduler_svc.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler_svc.core.in_flight import InFlight
    from scheduler_svc.core.scheduler import Scheduler

NO_DRAFTS: dict[str, int] = {}  # shared, never written: the step of a scheduler without drafts


def add_draft_slots(sched: Scheduler, cap: int, budget: int, scheduled: list[Request],
                    num_scheduled: dict[str, int],
                    new_blocks_of: dict[str, list[KVBlock]]) -> tuple[int, dict[str, int]]:
    """Give the decodes pass 1 scheduled their draft slots, in RUNNING order, from the
    budget left. Returns (budget left, {req_id: slots}) and extends the step's tables.

    Only a request whose one scheduled token is the last it has (a decode: it samples)
    gets slots (one with a grammar too: the worker drafts and verifies under its
    mask), and no step does while `disable_by_batch_size` or more requests are
    enqueued (running or waiting: a burst being admitted needs the budget for its
    prompts, and the batch it becomes is too large to gain from drafts).
    Slots take only free blocks: a step that had to preempt gets none (its memory is
    short, and a slot would hold a block a preempted request needs to resume), and no
    slot ever causes a preemption. They come before pass 2's admissions, as vLLM's spec
    tokens do (they are part of a running request's tokens there)."""
    spec = sched.config.speculative_config
    if not spec.speculates(len(sched.running) + len(sched.waiting)):
        return budget, NO_DRAFTS
    kv = sched.kv
    k = spec.num_speculative_tokens
    drafts: dict[str, int] = {}
    for request in scheduled:
        if budget <= 0:
            break
        req_id = request.req_id
        if num_scheduled[req_id] != 1 or request.gap != 1:
            continue  # a prefill chunk, or a token that does not sample
        held = len(kv.req_to_blocks[req_id])
        fits = (held + kv.num_free_blocks) * kv.block_size - request.num_computed_tokens - 1
        d = min(draft_slots(sched, request, k, cap, budget), fits)
        if d <= 0:
            continue
        more = kv.allocate_slots(request, 1 + d)  # fits: cannot fail
        if more:
            new_blocks_of[req_id] = [*new_blocks_of[req_id], *more]
        num_scheduled[req_id] = 1 + d
        drafts[req_id] = d
        budget -= d
    return budget, drafts


def draft_slots(sched: Scheduler, request: Request, k: int, cap: int, budget: int) -> int:
    """The budget clamp of a decode's slots: min(k, the budget left, the long-prefill
    cap less the decode's own token, max_model_len - 1 - computed - 1 (the request's
    last token is sampled, never computed: 1 + slots is the step's clamp of both passes),
    max_tokens - output - placeholders - 1 (every slot may commit a token, so no step
    may reach past max_tokens even when all are accepted))."""
    d = min(k, budget,
            sched.config.max_model_len - 2 - request.num_computed_tokens,
            request.max_tokens - len(request.output_token_ids)
            - request.num_output_placeholders - 1)
    if cap and d > cap - 1:
        d = cap - 1
    return d


def count_scheduled(request: Request, n: int, d: int, async_scheduling: bool) -> None:
    """Scheduling a decode with `d` slots: its positions are computed (the counter moves
    when work is scheduled), and the step may sample 1 + d tokens, all unknown yet:
    placeholders, as a multi-step's later passes are (async: all of them; sync: all but
    the one the gap already expects). The gap stays what one decode leaves."""
    request.num_computed_tokens += n
    request.num_output_placeholders += d + 1 if async_scheduling else d


def roll_back(request: Request, entry: InFlight, num_committed: int,
              async_scheduling: bool) -> int:
    """The worker committed `num_committed` tokens (1 + accepted drafts) where the step
    had 1 + d slots: the rejected slots' positions are no longer computed, and every
    placeholder the step added is resolved (its tokens are appended by the caller).
    A request preempted or finished since keeps its counters: preemption already
    dropped its computed work and placeholders (it drops drafts with them). Returns the
    number of rejected slots."""
    rejected = entry.num_drafts + 1 - num_committed
    if request.status is RequestStatus.RUNNING \
            and request.num_preemptions == entry.num_preemptions:
        request.num_computed_tokens -= rejected
        request.num_output_placeholders -= entry.num_drafts + 1 if async_scheduling \
            else entry.num_drafts
        request.num_rejected_tokens += rejected
    return rejected


def roll_back_step(sched: Scheduler, step: dict[str, InFlight], req_ids: list[str],
                   sampled_ids: list[list[int]], num_draft_tokens: list[int]) -> None:
    """Take back the slots the worker rejected in one step's answer (roll_back), before
    its KV is committed, and count what was proposed and accepted, as vLLM's
    spec-decode metrics do (drafts, draft tokens, accepted tokens, accepted tokens per
    position). num_draft_tokens: the drafts the worker proposed per request (empty
    from a worker that does not say: then every slot counts as proposed)."""
    async_ = sched.config.async_scheduling
    stats = sched._stats
    per_pos = sched._accepted_per_pos
    for i, (req_id, sampled) in enumerate(zip(req_ids, sampled_ids)):
        entry = step[req_id]
        if not entry.num_drafts or not sampled:  # no slots, or it ended before the step
            continue
        roll_back(entry.request, entry, len(sampled), async_)
        proposed = num_draft_tokens[i] if num_draft_tokens else entry.num_drafts
        accepted = len(sampled) - 1
        stats.spec_num_draft_slots += entry.num_drafts
        if proposed:
            stats.spec_num_drafts += 1
            stats.spec_num_draft_tokens += proposed
        stats.spec_num_accepted_tokens += accepted
        for j in range(accepted):
            per_pos[j] += 1


def committed_kv_end(request: Request, entry: InFlight) -> int:
    """How many leading positions of the request hold the KV of committed tokens once
    this step is done: what it was scheduled to reach, less every slot rejected since
    it was scheduled (its own and those of the step before it, whose answer came
    after: it was scheduled as if they had been accepted). Blocks past this end hold
    a rejected draft's KV, or none yet, and must not enter the prefix cache."""
    return entry.num_computed_after - (request.num_rejected_tokens - entry.rejected_before)
