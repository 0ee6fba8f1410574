"""A small test harness that speaks the SchedulerOutput contract to a ModelRunner:
it allocates blocks from a free list, chunks prompts to a token budget, appends the
sampled tokens and reports finished requests, like the scheduler does. It decides
nothing clever; the tests choose what it schedules."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.stop_rule import is_stop, stop_ids
from shared.token_checksum import token_checksum
from shared.types import (CachedRequestData, NewRequestData, SamplingParams,
                          SchedulerOutput)


@dataclass(slots=True)
class DriverRequest:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent: bool = False
    resumed: bool = False  # preempted since it last ran: its next blocks replace the table
    stopped: bool = False  # sampled a stop token (the scheduler's rule, as the worker's)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return self.stopped or len(self.output) >= self.max_new

    def take(self, tokens: list[int], eos: frozenset[int]) -> None:
        p = self.params
        for j, token in enumerate(tokens):
            self.output.append(token)
            if is_stop(token, len(self.output), stop_ids(p, eos), p.min_tokens):  # shared rule
                self.stopped = True
                assert j == len(tokens) - 1, "the worker ran passes after a stop"


class StepDriver:
    def __init__(self, runner, free_blocks: list[int] | None = None):
        self.runner = runner
        self.block_size = runner.block_size
        # hand out blocks from the end of the list first: a freed block is reused soon
        self.free = free_blocks if free_blocks is not None \
            else list(range(runner.num_kv_blocks - 1, 0, -1))
        self.requests: dict[str, DriverRequest] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.step_id = 0
        # the stop rule's EOS ids: a ModelRunner's, or a rank group's (tp_group.py)
        self.eos = frozenset(runner.model_config.eos_token_ids if hasattr(runner, "model_config")
                             else runner.eos_token_ids)

    def add(self, req_id: str, prompt: list[int], max_new: int,
            params: SamplingParams | None = None) -> DriverRequest:
        req = DriverRequest(req_id, list(prompt), params or SamplingParams(temperature=0.0),
                            max_new)
        self.requests[req_id] = req
        return req

    def step(self, plan: dict[str, int] | None = None, num_steps: int = 1):
        """Schedule `plan` (req_id -> tokens; default: each live request's whole gap).
        num_steps > 1: a multi-step decode (the plan's requests one token each), whose
        blocks cover every pass."""
        live = {r: q for r, q in self.requests.items() if not q.done}
        plan = plan or {r: len(q.tokens) - q.computed for r, q in live.items()}
        out = SchedulerOutput(step_id=self.step_id, finished_req_ids=self.finished,
                              preempted_req_ids=self.preempted, num_steps=num_steps)
        self.finished, self.preempted = set(), set()
        self.step_id += 1
        cached = CachedRequestData()
        for req_id, n in plan.items():
            req = self.requests[req_id]
            advance = n if num_steps == 1 else num_steps
            need = -(-(req.computed + advance) // self.block_size) - len(req.blocks)
            new_blocks = [self.free.pop() for _ in range(max(need, 0))]
            req.blocks.extend(new_blocks)
            if not req.sent:
                out.scheduled_new_reqs.append(NewRequestData(  # output: resent after a loss
                    req_id, list(req.prompt), req.params, list(req.blocks), req.computed,
                    output_token_ids=list(req.output)))
                req.sent = True
            else:
                check = (len(req.tokens), token_checksum(req.tokens)) if req.resumed else None
                cached.append(req_id, req.resumed, new_blocks, req.computed, check)
                req.resumed = False
            out.num_scheduled_tokens[req_id] = n
            req.computed += advance
        out.scheduled_cached_reqs = cached
        out.total_num_scheduled_tokens = sum(plan.values())
        result = self.runner.execute(out)
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids):
            req = self.requests[req_id]
            req.take(tokens, self.eos)
            if req.done:
                self.finished.add(req_id)
                self.free.extend(reversed(req.blocks))
                req.blocks = []
        return result

    def preempt(self, req_id: str) -> None:
        """Recompute-style preemption: blocks freed, progress reset, tokens kept."""
        req = self.requests[req_id]
        self.free.extend(reversed(req.blocks))
        req.blocks, req.computed, req.resumed = [], 0, True
        self.preempted.add(req_id)

    def run_to_completion(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if all(q.done for q in self.requests.values()):
                return
            self.step()
        raise AssertionError("requests did not finish")


def tiny_cpu_runner(path, **config):
    """A CPU ModelRunner for a tiny test checkpoint: 64 blocks, 8 rows, 256 positions."""
    from worker_svc.config import WorkerConfig
    from worker_svc.runner import ModelRunner
    return ModelRunner(WorkerConfig(model=str(path), device="cpu", max_model_len=256,
                                    num_gpu_blocks_override=64, max_num_seqs=8, **config))


def run_outputs(runner, prompts: list[list[int]], max_new: int,
                params: list[SamplingParams] | None = None) -> list[list[int]]:
    """Each prompt's generated tokens (greedy unless params say otherwise), all run
    together to completion."""
    driver = StepDriver(runner)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, max_new=max_new, params=params[i] if params else None)
    driver.run_to_completion()
    return [driver.requests[f"r{i}"].output for i in range(len(prompts))]
