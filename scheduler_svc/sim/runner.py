"""Drives the real scheduler against a simulated worker on a simulated clock.

Time advances step by step: a step's tokens exist at its end, and requests that
arrive during a step join at the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


from scheduler_svc.core import Scheduler, SchedulerConfig
from scheduler_svc.sim.step_model import StepModel
from scheduler_svc.sim.workload import SimRequest
from shared.request_limits import token_ids_problem
from shared.types import InvalidRequestError, ModelRunnerOutput, SchedulerOutput

SAMPLED_TOKEN = 7  # what the simulated worker samples; outputs end by length


@dataclass(slots=True)
class GroupTimes:
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SimResult:
    groups: dict[str, GroupTimes]
    preemptions: int
    recomputed_tokens: int
    makespan_ms: float
    num_steps: int


def simulated_worker_output(sched: Scheduler, so: SchedulerOutput) -> ModelRunnerOutput:
    """A token for every request whose step reached the end of its known tokens, one
    per forward pass of the step (several in a multi-step decode)."""
    reqs = sched.requests
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(step_id=so.step_id, req_ids=ids, sampled_token_ids=[
        [SAMPLED_TOKEN] * so.num_steps if reqs[i].num_computed_tokens >= reqs[i].num_tokens
        else [] for i in ids])


def simulate(config: SchedulerConfig, num_blocks: int, requests: list[SimRequest],
             model: StepModel) -> SimResult:
    sched = Scheduler(config, num_blocks)  # preemptions are counted in the report
    for r in requests:  # the workload is the simulator's door: the core only asserts
        problem = token_ids_problem(r.request.prompt_token_ids, config.max_model_len)
        if problem is not None:
            raise InvalidRequestError(problem)
    groups = {r.group: GroupTimes() for r in requests}
    group_of = {r.request.req_id: r.group for r in requests}
    arrival = {r.request.req_id: r.arrival_ms for r in requests}
    last_token_ms: dict[str, float] = {}
    now = 0.0
    nxt = 0  # next request to arrive
    steps = 0
    while nxt < len(requests) or sched.has_unfinished_requests():
        while nxt < len(requests) and requests[nxt].arrival_ms <= now:
            sched.add_request(requests[nxt].request)
            nxt += 1
        if not sched.has_unfinished_requests():
            now = requests[nxt].arrival_ms  # idle until the next arrival
            continue
        so = sched.schedule()
        if not so.num_scheduled_tokens:
            raise RuntimeError("the scheduler made no progress with requests pending")
        now += model.step_ms(so) * so.num_steps  # a multi-step decode: that many passes
        steps += 1
        for out in sched.update_from_output(so, simulated_worker_output(sched, so)):
            if not out.new_token_ids:
                continue
            req_id = out.req_id
            times = groups[group_of[req_id]]
            prev = last_token_ms.get(req_id)
            if prev is None:
                times.ttft_ms.append(now - arrival[req_id])
            else:  # tokens that arrive together share the gap, as the frontend's ITL does
                n = len(out.new_token_ids)
                times.itl_ms.extend([(now - prev) / n] * n)
            last_token_ms[req_id] = now
    stats = sched.stats()
    return SimResult(groups, stats.num_preemptions_total, stats.num_recomputed_tokens_total,
                     now, steps)
