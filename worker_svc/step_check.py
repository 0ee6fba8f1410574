"""Validation of one SchedulerOutput against the worker's state, done in full before
anything changes: a bad step (or a bad request in it) raises and leaves the worker
exactly as it was."""

from __future__ import annotations

from shared.request_limits import token_ids_problem
from shared.token_checksum import token_checksum
from shared.types import MAX_NUM_STEPS, InvalidRequestError, SchedulerOutput
from worker_svc.worker_request import WorkerRequest


class StepError(ValueError):
    """The step contradicts what this worker holds: a scheduler/worker desync."""


def check_step(step: SchedulerOutput, requests: dict[str, WorkerRequest], *, vocab_size: int,
               max_model_len: int, num_blocks: int, block_size: int) -> None:
    finished = step.finished_req_ids
    # per request after this step's increments: (known tokens, blocks held, computed)
    after: dict[str, tuple[int, int, int]] = {}
    stopped: set[str] = set()
    for new in step.scheduled_new_reqs:
        _check_new(new, requests, finished, after, vocab_size, max_model_len)
        _check_blocks(new.req_id, new.block_ids, num_blocks)
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
        _check_blocks(req_id, cached.new_block_ids[i], num_blocks)
        if cached.resumed_from_preemption[i]:
            _check_tokens(req_id, state, cached.resumed_token_checks.get(req_id))
        held = 0 if cached.resumed_from_preemption[i] or req_id in step.preempted_req_ids \
            else len(state.block_ids)
        if state.stopped and not cached.resumed_from_preemption[i]:
            # it stopped here on a token the scheduler had not seen when it scheduled
            # this step: the runner skips it, so its counts need not add up
            stopped.add(req_id)
        after[req_id] = (len(state.token_ids), held + len(cached.new_block_ids[i]),
                         cached.num_computed_tokens[i])
    if set(step.num_scheduled_tokens) != set(after):
        raise StepError("num_scheduled_tokens must name exactly the scheduled new and "
                        "cached requests")
    if sum(step.num_scheduled_tokens.values()) != step.total_num_scheduled_tokens:
        raise StepError("total_num_scheduled_tokens is not the sum of num_scheduled_tokens")
    for req_id in stopped:
        del after[req_id]
    for req_id, (num_tokens, num_held_blocks, computed) in after.items():
        n = step.num_scheduled_tokens[req_id]
        end = computed + n
        if n < 1 or computed < 0:
            raise StepError(f"request {req_id!r}: scheduled {n} tokens from {computed}")
        if end > num_tokens:
            raise StepError(f"request {req_id!r}: positions up to {end} scheduled but only "
                            f"{num_tokens} tokens are known")
        _check_room(req_id, end, num_held_blocks, max_model_len, block_size)
    if step.num_steps != 1:
        _check_multi_step(step, after, max_model_len, block_size)


def _check_multi_step(step: SchedulerOutput, after: dict[str, tuple[int, int, int]],
                      max_model_len: int, block_size: int) -> None:
    """A multi-step decode: every request (but the stopped ones, not in `after`) one
    token that samples, and room (positions, blocks) for the token each of the step's
    passes computes."""
    steps = step.num_steps
    if not 1 <= steps <= MAX_NUM_STEPS:
        raise StepError(f"num_steps {steps} outside [1, {MAX_NUM_STEPS}]")
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


def _check_blocks(req_id: str, block_ids: list[int], num_blocks: int) -> None:
    for b in block_ids:
        if not 0 < b < num_blocks:
            raise StepError(f"request {req_id!r}: block id {b} outside [1, {num_blocks})")
