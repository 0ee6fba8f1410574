"""Speculative decoding across a worker SIGKILL (docs/resilience.md, docs/spec_decode.md):
the stack of tests/integration/test_resilience.py with --speculative-config. The worker
stops itself mid-stream with drafts in flight, is killed and replaced; the scheduler
resends each request with its committed output (never a draft: rejected slots were
taken back, and a step in flight is simply lost), and every stream, greedy or seeded,
ends with exactly the text of the no-fault run."""

from __future__ import annotations

import signal

import pytest

from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.ports import free_ports
from tests.integration.test_resilience import (FAULT_ENV, MAX_TOKENS, STEP_TIMEOUT_S,
                                               assert_recovered,
                                               greedy, replace_worker, scheduler_metric, seeded,
                                               start_faulty_run)

SPECS = {
    "ngram": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
             '"prompt_lookup_max": 3}',
    "int8_self_draft": '{"method": "draft_model", "quantization": "int8", '
                       '"num_speculative_tokens": 4}',
}
# A step commits up to 1 + k tokens (k <= 4 here): the fault comes after fewer steps
# than without drafts, so it still lands before any stream can end: 8 steps commit at
# most 40 of a greedy stream's 64 tokens. Seeded streams of the random-weight model
# accept few drafts (about 1.4 tokens a step, against nearly 5 for greedy ones) and
# their steps cost more (each verified row draws its (seed, position) noise over the
# whole vocabulary), so they run 32 tokens with the fault after 6 steps (at most 30
# tokens: still mid-stream by construction), which halves the variant's time.
FAULT_AFTER_STEPS = 8


def spec_fault_stack(tiny_model_dir, log_dir, method, fault_after_steps=FAULT_AFTER_STEPS):
    (metrics_port,) = free_ports(1)
    return start_stack(tiny_model_dir, log_dir, flags=[
        *TINY_FLAGS, "--step-timeout-s", str(STEP_TIMEOUT_S),
        "--scheduler-metrics-port", str(metrics_port),
        "--speculative-config", SPECS[method]],
        env={FAULT_ENV: str(fault_after_steps)}), metrics_port


@pytest.mark.parametrize("method, sampling, fault_after_steps, max_tokens", [
    ("ngram", greedy, FAULT_AFTER_STEPS, MAX_TOKENS),
    ("int8_self_draft", greedy, FAULT_AFTER_STEPS, MAX_TOKENS),
    ("int8_self_draft", seeded(2000), 6, 32)],
    ids=["ngram-greedy", "int8_self_draft-greedy", "int8_self_draft-seeded"])
def test_streams_with_drafts_across_a_worker_sigkill_equal_the_no_fault_run(
        tiny_model_dir, tmp_path, method, sampling, fault_after_steps, max_tokens):
    assert fault_after_steps * (1 + 4) < max_tokens  # the fault lands mid-stream
    stack, metrics_port = spec_fault_stack(tiny_model_dir, tmp_path / "stack", method,
                                           fault_after_steps)
    try:
        run = start_faulty_run(stack, sampling, max_tokens)
        assert scheduler_metric(metrics_port,
                                "gapserve:spec_decode_num_draft_tokens_total") > 0
        replace_worker(stack)
        assert_recovered(stack, metrics_port, run, sampling)
    finally:
        worker = stack.process("worker")
        if worker.poll() is None:
            worker.send_signal(signal.SIGCONT)
        stack.stop()
