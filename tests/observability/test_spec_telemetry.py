"""Speculative decoding's telemetry at the scheduler (scheduler_svc/spec_metrics.py):
vLLM's spec_decode_* counters follow the cumulative stats, the draft time is a
histogram, and a step's span says how many slots it gave and how many drafts its
worker proposed and got accepted."""

from __future__ import annotations

from shared.types import ModelRunnerOutput, StepTimings
from tests.observability.helpers import sample
from tests.observability.test_scheduler_telemetry import Stats, new_step, telemetry


def test_the_counters_follow_the_cumulative_stats_by_their_increments(captured):
    captured("scheduler")
    tel = telemetry(model="spec-m", num_speculative_tokens=3)
    for drafts, tokens, accepted, per_pos in ((2, 5, 3, (2, 1, 0)), (3, 8, 5, (3, 1, 1))):
        tel.refresh(Stats(spec_num_drafts=drafts, spec_num_draft_tokens=tokens,
                          spec_num_accepted_tokens=accepted,
                          spec_num_accepted_tokens_per_pos=per_pos))
    m = {"model_name": "spec-m"}
    assert sample("gapserve:spec_decode_num_drafts_total", **m) == 3
    assert sample("gapserve:spec_decode_num_draft_tokens_total", **m) == 8
    assert sample("gapserve:spec_decode_num_accepted_tokens_total", **m) == 5
    assert [sample("gapserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i),
                   **m) for i in range(3)] == [3, 1, 1]


def test_a_step_span_carries_its_slots_drafts_and_accepted_tokens(captured):
    out = captured("scheduler")
    tel = telemetry(model="spec-span", num_speculative_tokens=4)
    step = new_step(1, cached=["a", "b", "c"])
    step.num_draft_slots = {"a": 4, "b": 2}
    step.num_scheduled_tokens = {"a": 5, "b": 3, "c": 1}
    tel.step_scheduled(step, Stats(num_running=3))
    tel.step_finished(1, ModelRunnerOutput(
        1, ["a", "b", "c"], [[5, 6, 7], [8], [9]], timings=StepTimings(draft_ms=1.5),
        num_draft_tokens=[4, 1, 0]))
    [span] = out.spans("scheduler.step")
    assert span.attributes["gapserve.step.num_draft_slots"] == 6
    assert span.attributes["gapserve.step.num_draft_tokens"] == 5
    assert span.attributes["gapserve.step.num_accepted_tokens"] == 2
    assert span.attributes["gapserve.worker.draft_ms"] == 1.5
    assert sample("gapserve:spec_decode_draft_seconds_count", model_name="spec-span") == 1
