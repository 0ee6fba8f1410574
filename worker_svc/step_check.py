"""Validation of one SchedulerOutput against the worker's state, done in full before
anything changes: a bad step (or a bad request in it) raises and leaves the worker
exactly as it was."""

from __future__ import annotations

from shared.kv_window import first_needed_position
from shared.request_limits import token_ids_problem
from shared.token_checksum import token_checksum
from shared.types import MAX_NUM_STEPS, InvalidRequestError, SchedulerOutput
from worker_svc.worker_request import WorkerRequest


class StepError(ValueError):
    """The step contradicts what this worker holds: a scheduler/worker desync."""


def check_step(step: SchedulerOutput, requests: dict[str, WorkerRequest], *, vocab_size: int,
               max_model_len: int, num_blocks: int, block_size: int,
               sliding_window: int = 0, lookback: int = 0) -> None:
    """sliding_window, lookback: ModelInfo's window and the draft slots a request may
    roll back; a new or resumed request's table may then start with null blocks (0)
    wholly behind the window of its first computed token (shared/kv_window.py)."""

    def nulls_allowed(num_computed: int) -> int:
        return first_needed_position(num_computed, sliding_window, lookback) \
            // block_size if sliding_window else 0

    if not 1 <= step.num_steps <= MAX_NUM_STEPS:  # the step's shape before its requests
        raise StepError(f"num_steps {step.num_steps} outside [1, {MAX_NUM_STEPS}]")
    finished = step.finished_req_ids
    # per request after this step's increments: (known tokens, blocks held, computed)
    after: dict[str, tuple[int, int, int]] = {}
    stopped: set[str] = set()
    for new in step.scheduled_new_reqs:
        _check_new(new, requests, finished, after, vocab_size, max_model_len)
        _check_blocks(new.req_id, new.block_ids, num_blocks,
                      nulls_allowed(new.num_computed_tokens))
        after[new.req_id] = (len(new.prompt_token_ids) + len(new.output_token_ids),
                             len(new.block_ids),
                             new.num_computed_tokens)
    cached = step.scheduled_cached_reqs
    columns = (cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens)
    if any(len(c) != len(cached.req_ids) for c in columns):
        raise StepError("scheduled_cached_reqs columns differ in length")
    for i, req_id in enumerate(cached.req_ids):
        state = requests.get(req_id)
        if state is None or req_id in finished or req_id in after:
            raise StepError(f"cached request {req_id!r} is not held by this worker "
                            "(unknown, finished, or also sent as new)")
        _check_blocks(req_id, cached.new_block_ids[i], num_blocks,
                      nulls_allowed(cached.num_computed_tokens[i])
                      if cached.resumed_from_preemption[i] else 0)
        if cached.resumed_from_preemption[i]:
            _check_tokens(req_id, state, cached.resumed_token_checks.get(req_id))
        held = 0 if cached.resumed_from_preemption[i] or req_id in step.preempted_req_ids \
            else len(state.block_ids)
        computed = cached.num_computed_tokens[i]
        if state.stopped and not cached.resumed_from_preemption[i]:
            # it stopped here on a token the scheduler had not seen when it scheduled
            # this step: the runner skips it, so its counts need not add up
            stopped.add(req_id)
        elif not cached.resumed_from_preemption[i]:
            computed = own_computed(step.step_id, req_id, state, computed)
        after[req_id] = (len(state.token_ids), held + len(cached.new_block_ids[i]), computed)
    if set(step.num_scheduled_tokens) != set(after):
        raise StepError("num_scheduled_tokens must name exactly the scheduled new and "
                        "cached requests")
    if sum(step.num_scheduled_tokens.values()) != step.total_num_scheduled_tokens:
        raise StepError("total_num_scheduled_tokens is not the sum of num_scheduled_tokens")
    for req_id in stopped:
        del after[req_id]
    slots = step.num_draft_slots
    for req_id, (num_tokens, num_held_blocks, computed) in after.items():
        n = step.num_scheduled_tokens[req_id]
        d = slots.get(req_id, 0) if slots else 0
        end = computed + n - d  # what it computes of its known tokens
        if n - d < 1 or computed < 0 or d < 0:
            raise StepError(f"request {req_id!r}: scheduled {n} tokens ({d} draft slots) "
                            f"from {computed}")
        if end > num_tokens or (d and end != num_tokens):
            raise StepError(f"request {req_id!r}: positions up to {end} scheduled but " + (
                f"only {num_tokens} tokens are known" if end > num_tokens else
                f"{d} draft slots follow only the last of {num_tokens} known tokens"))
        _check_room(req_id, end + d, num_held_blocks, max_model_len, block_size)
    if slots and (set(slots) - set(step.num_scheduled_tokens) or step.num_steps != 1):
        raise StepError("draft slots name a request not scheduled, or a multi-step decode")
    if step.num_steps != 1:
        _check_multi_step(step, after, max_model_len, block_size)


def own_computed(step_id: int, req_id: str, state: WorkerRequest, sent: int) -> int:
    """The count this worker runs a cached request from: its own. The scheduler's is
    the same, except that a step scheduled before the answer of the step just before
    it (async scheduling) counts that step's draft slots as all accepted: then it is
    ours plus exactly the slots we rejected there (docs/spec_decode.md). Anything
    else is a desync."""
    own = state.num_computed_tokens
    if sent == own:
        return own
    last = state.last_rejection
    if last is not None and last[0] == step_id - 1 and sent == own + last[1]:
        return own
    raise StepError(f"request {req_id!r}: the scheduler says {sent} positions are "
                    f"computed, this worker holds {own}" + (
                        f" (it rejected {last[1]} draft slot(s) in step {last[0]})"
                        if last is not None else ""))


def _check_multi_step(step: SchedulerOutput, after: dict[str, tuple[int, int, int]],
                      max_model_len: int, block_size: int) -> None:
    """A multi-step decode: every request (but the stopped ones, not in `after`) one
    token that samples, and room (positions, blocks) for the token each of the step's
    passes computes."""
    steps = step.num_steps
    for req_id, (num_tokens, num_held_blocks, computed) in after.items():
        n = step.num_scheduled_tokens[req_id]
        if n != 1 or computed + 1 != num_tokens:
            raise StepError(f"a multi-step decode of {steps} passes must schedule one "
                            f"token that samples; request {req_id!r} has {n} from "
                            f"{computed} of {num_tokens}")
        _check_room(req_id, computed + steps, num_held_blocks, max_model_len, block_size,
                    f" of {steps} passes")


def _check_room(req_id: str, end: int, num_held_blocks: int, max_model_len: int,
                block_size: int, of: str = "") -> None:
    """Positions up to `end` must fit max_model_len and the request's blocks."""
    if end > max_model_len:
        raise StepError(f"request {req_id!r}: {end} tokens{of} exceed max_model_len "
                        f"{max_model_len}")
    if num_held_blocks * block_size < end:
        raise StepError(f"request {req_id!r}: {num_held_blocks} blocks cannot hold "
                        f"{end} tokens{of}")


def _check_tokens(req_id: str, state: WorkerRequest, check: tuple[int, int] | None) -> None:
    """The scheduler's token ids of a resumed request must be this worker's: the KV is
    about to be recomputed from them, and every later token depends on it."""
    if check is None:
        raise StepError(f"resumed request {req_id!r} carries no token check")
    num_tokens, checksum = check
    mine = len(state.token_ids)
    if num_tokens != mine or checksum != token_checksum(state.token_ids):
        raise StepError(
            f"request {req_id!r}: token ids drifted between scheduler and worker at its "
            f"resume: the scheduler holds {num_tokens} tokens (checksum {checksum:016x}), "
            f"this worker {mine} (checksum {token_checksum(state.token_ids):016x})")


def _check_new(new, requests, finished, after, vocab_size: int, max_model_len: int) -> None:
    if (new.req_id in requests and new.req_id not in finished) or new.req_id in after:
        raise StepError(f"new request {new.req_id!r} is already held by this worker")
    new.sampling_params.validate(vocab_size)
    prompt = new.prompt_token_ids
    # the scheduler's invariants (shared/request_limits.py), prompt alone then with output
    problem = token_ids_problem(prompt, max_model_len, vocab_size,
                                what=f"request {new.req_id!r}: the prompt")
    if problem is None and new.output_token_ids:
        problem = token_ids_problem([*prompt, *new.output_token_ids], max_model_len,
                                    vocab_size, what=f"request {new.req_id!r}: its tokens")
    if problem is not None:
        raise InvalidRequestError(problem)
    num_tokens = len(prompt) + len(new.output_token_ids)
    if not 0 <= new.num_computed_tokens < num_tokens:
        raise StepError(f"request {new.req_id!r}: num_computed_tokens "
                        f"{new.num_computed_tokens} outside [0, {num_tokens})")


def _check_blocks(req_id: str, block_ids: list[int], num_blocks: int,
                  leading_nulls: int = 0) -> None:
    """Ids in [1, num_blocks), but for up to `leading_nulls` leading nulls (0): blocks
    a sliding window left behind, which the attention never reads."""
    for i, b in enumerate(block_ids):
        if not 0 < b < num_blocks and not (b == 0 and i < leading_nulls
                                           and not any(block_ids[:i])):
            raise StepError(f"request {req_id!r}: block id {b} outside [1, {num_blocks})")
