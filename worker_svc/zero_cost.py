"""--zero-cost-steps: a step that does no model work, to measure the serving stack.

The worker checks the step and updates its request state as usual, then skips input
preparation, the forward pass and sampling: every request that would sample gets a
made-up ordinary token at once. What is left is the cost of the frontend, scheduler,
gRPC and this process's bookkeeping per token: the ceiling the stack puts on any
accelerator (benchmarks/stack_ceiling.py). Tokens avoid the ids at both ends of the
vocabulary, where tokenizers keep their special tokens, so they detokenize to text.
"""

from __future__ import annotations

import time

from shared.types import ModelRunnerOutput, StepTimings
from worker_svc.worker_request import WorkerRequest

LOW_IDS_SKIPPED = HIGH_IDS_SKIPPED = 1000  # specials sit at the start (SmolLM, Llama 2)
# or at the end (Llama 3, Qwen2) of the vocabulary


def made_up_token(state: WorkerRequest, vocab_size: int) -> int:
    skip = min(LOW_IDS_SKIPPED, HIGH_IDS_SKIPPED, vocab_size // 8)  # tiny test vocabularies
    span = max(vocab_size - 2 * skip, 1)
    return skip + (len(state.token_ids) * 7919) % span


def zero_cost_step(out: ModelRunnerOutput, states: list[WorkerRequest], live: list[int],
                   num_scheduled: list[int], vocab_size: int, eos: frozenset[int], t0: float,
                   start_unix: float, num_steps: int = 1) -> ModelRunnerOutput:
    """`out` comes with empty token lists; `live` are the states not stopped."""
    out.logprobs = [None] * len(states)
    passes = num_tokens = 0
    for i in live:
        state, n = states[i], num_scheduled[i]
        for k in range(num_steps):  # a multi-step decode: one token a pass, until a stop
            if state.stopped:
                break
            state.num_computed_tokens += n
            num_tokens += n
            passes = max(passes, k + 1)
            if state.num_computed_tokens >= len(state.token_ids):  # prompt done: it samples
                token = made_up_token(state, vocab_size)
                state.record_sampled(token, eos)
                out.sampled_token_ids[i].append(token)
    out.timings = StepTimings(prepare_ms=(time.perf_counter() - t0) * 1e3,
                              start_unix_s=start_unix, end_unix_s=time.time(),
                              num_forward_passes=passes, num_tokens=num_tokens)
    return out
