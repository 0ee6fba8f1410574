"""The real scheduler core and a real ModelRunner in one process, without a network:
each step crosses the wire mapping both ways (shared/wire), and under async scheduling
step N+1 is scheduled before step N's answer is applied, as the engine does, while
the worker executes steps strictly in order. Tests of speculative decoding drive
whole workloads through it and compare the streams."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler
from shared.speculative_config import parse_speculative_config
from shared.types import FinishReason, SamplingParams
from shared.wire import worker as wire


def run(runner, prompts: list[list[int]], params: list[SamplingParams], *,
        async_scheduling: bool = True, num_blocks: int | None = None,
        on_step: Callable[[Scheduler, int], None] | None = None,
        record: list | None = None, priorities: list[int] | None = None,
        on_output: Callable | None = None, **config) -> tuple[dict[str, list[int]], dict[str, FinishReason], Scheduler]:
    """Serve every prompt to its end. The scheduler adopts the runner's speculative
    config (as from the handshake). on_step(scheduler, step index) runs before each
    schedule (a test may preempt there); record, if given, collects every step sent;
    on_output(RequestOutput) sees every output.
    Returns (tokens, finish reasons, scheduler)."""
    info = runner.model_info()
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_model_len", info.max_model_len)
    config.setdefault("sliding_window", info.sliding_window)  # as from the handshake
    config.setdefault("long_prompt_rope_from", info.long_prompt_rope_from)
    cfg = SchedulerConfig(block_size=info.block_size, async_scheduling=async_scheduling, hash_seed="test",
                          speculative_config=parse_speculative_config(
                              info.speculative_config), **config)
    sched = Scheduler(cfg, num_blocks or info.num_kv_blocks)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        sched.add_request(Request(f"r{i}", prompt, p, info.eos_token_ids, float(i),
                                  priorities[i] if priorities else 0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    reasons: dict[str, FinishReason] = {}
    in_flight: deque = deque()
    depth = 2 if async_scheduling else 1
    step = 0
    while sched.has_unfinished_requests() or in_flight:
        if len(in_flight) < depth and sched.has_unfinished_requests():
            if on_step is not None:
                on_step(sched, step)
            step += 1
            so = sched.schedule()
            # an empty step too when nothing is in flight: the poll that collects the
            # grammars the worker compiled for deferred requests
            if so.num_scheduled_tokens or so.finished_req_ids or so.grammar_compiles \
                    or not in_flight:
                sent = wire.scheduler_output_from_proto(wire.scheduler_output_to_proto(so))
                if record is not None:
                    record.append(sent)
                answer = runner.execute(sent)
                in_flight.append((so, wire.runner_output_from_proto(
                    wire.runner_output_to_proto(answer))))
                continue
        so, answer = in_flight.popleft()
        for out in sched.update_from_output(so, answer):
            if on_output is not None:
                on_output(out)
            tokens[out.req_id] += out.new_token_ids
            if out.finish_reason is not None:
                reasons[out.req_id] = out.finish_reason
    # the worker drops what the scheduler finished last
    runner.execute(wire.scheduler_output_from_proto(wire.scheduler_output_to_proto(
        sched.schedule())))
    return tokens, reasons, sched
