"""SchedulerTelemetry: step spans link to request spans, the request lifecycle,
the preemption warning and counters, gauges and the diagnosis metric."""

from __future__ import annotations

from opentelemetry import trace

from scheduler_svc.core.stats import SchedulerStats
from scheduler_svc.metrics import SchedulerTelemetry
from shared.telemetry import extract_context, get_tracer
from shared.types import (FinishReason, ModelRunnerOutput, NewRequestData,
                          RequestOutput, SamplingParams, SchedulerOutput, StepTimings)
from tests.observability.helpers import sample


Stats = SchedulerStats  # what Scheduler.stats() returns


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def new_step(step_id, new=(), cached=(), resumed=(), preempted=(), tokens=None):
    out = SchedulerOutput(step_id=step_id)
    for rid in new:
        out.scheduled_new_reqs.append(NewRequestData(rid, [1, 2, 3], SamplingParams(), [1], 0))
    for rid in cached:
        out.scheduled_cached_reqs.append(rid, rid in resumed, [], 0)
    out.num_scheduled_tokens = {rid: (tokens or 1) for rid in (*new, *cached)}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    out.preempted_req_ids = set(preempted)
    return out


def telemetry(model="m", clock=None, **kw) -> SchedulerTelemetry:
    return SchedulerTelemetry(model, max_num_seqs=4, max_num_batched_tokens=64,
                              clock=clock or Clock(), **kw)


def test_step_span_links_to_the_requests_it_served_and_is_not_their_parent(captured):
    out = captured("scheduler")
    tel = telemetry()
    tel.request_added("a", 3, SamplingParams(max_tokens=2, temperature=0.0))
    tel.request_added("b", 3, SamplingParams(max_tokens=2))
    tel.step_scheduled(new_step(1, new=["a", "b"], tokens=3), Stats(num_running=2))
    tel.step_finished(1, ModelRunnerOutput(1, timings=StepTimings(forward_ms=5.0)))
    tel.request_outputs([RequestOutput("a", [7], finish_reason=FinishReason.LENGTH),
                         RequestOutput("b", [8], finish_reason=FinishReason.STOP)])
    [step] = out.spans("scheduler.step")
    requests = out.spans("scheduler.request")
    assert {link.context.span_id for link in step.links} == {
        r.context.span_id for r in requests}
    assert step.parent is None
    assert all(r.context.trace_id != step.context.trace_id for r in requests)
    assert step.attributes["gapserve.step.num_scheduled_tokens"] == 6
    assert step.attributes["gapserve.step.num_new_reqs"] == 2
    assert step.attributes["gapserve.step.budget_used"] == 6 / 64
    assert step.attributes["gapserve.worker.forward_ms"] == 5.0


def test_request_span_continues_the_frontend_trace_with_genai_attributes(captured):
    out = captured("scheduler")
    with get_tracer("frontend").start_as_current_span("root") as root:
        carrier = {"traceparent": format_traceparent(root)}
    tel = telemetry(model="smol")
    tel.request_added("a", 3, SamplingParams(max_tokens=5, temperature=0.0), carrier)
    tel.step_scheduled(new_step(1, new=["a"], tokens=3), Stats(num_running=1))
    tel.request_outputs([RequestOutput("a", [7])])
    tel.request_outputs([RequestOutput("a", [8], finish_reason=FinishReason.STOP)])
    [req] = out.spans("scheduler.request")
    assert req.context.trace_id == root.get_span_context().trace_id
    assert req.parent.span_id == root.get_span_context().span_id
    assert req.attributes["gen_ai.request.model"] == "smol"
    assert req.attributes["gen_ai.request.max_tokens"] == 5
    assert req.attributes["gen_ai.request.temperature"] == 0.0
    assert req.attributes["gen_ai.usage.input_tokens"] == 3
    assert req.attributes["gen_ai.usage.output_tokens"] == 2
    assert req.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert [e.name for e in req.events] == ["queued", "first_scheduled", "first_token",
                                            "finished"]


def test_a_continuations_request_span_says_how_much_of_its_prompt_is_output(captured):
    out = captured("scheduler")
    tel = telemetry(model="smol")
    tel.request_added("a@resume1", 9, SamplingParams(num_output_prefix_tokens=4), {})
    tel.request_added("b", 3, SamplingParams(), {})
    tel.request_outputs([RequestOutput(r, [7], finish_reason=FinishReason.LENGTH)
                         for r in ("a@resume1", "b")])
    spans = {s.attributes["gen_ai.request.id"]: s for s in out.spans("scheduler.request")}
    assert spans["a@resume1"].attributes["gapserve.request.num_output_prefix_tokens"] == 4
    assert "gapserve.request.num_output_prefix_tokens" not in spans["b"].attributes


def format_traceparent(span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"


def test_preemption_is_an_event_with_the_cumulative_count_and_a_warning(captured):
    out = captured("scheduler")
    tel = telemetry(model="preempt-test")
    before = sample("gapserve:num_preemptions_total", model_name="preempt-test")
    tel.request_added("a", 3, SamplingParams())
    tel.request_added("b", 3, SamplingParams())
    tel.step_scheduled(new_step(1, new=["a", "b"]), Stats(num_running=2))
    tel.step_scheduled(new_step(2, cached=["a"], preempted=["b"]),
                       Stats(num_running=1, num_waiting=1, num_preemptions_total=1))
    tel.step_scheduled(new_step(3, cached=["a", "b"], resumed=["b"]), Stats(num_running=2))
    tel.step_scheduled(new_step(4, cached=["a"], preempted=["b"]),
                       Stats(num_running=1, num_waiting=1, num_preemptions_total=2))
    tel.request_finished("b", FinishReason.ABORT)
    assert sample("gapserve:num_preemptions_total", model_name="preempt-test") == before + 2
    b = next(s for s in out.spans("scheduler.request") if s.attributes["gen_ai.request.id"] == "b")
    events = [(e.name, dict(e.attributes)) for e in b.events]
    assert ("preempted", {"gapserve.request.num_preemptions": 1}) in events
    assert ("preempted", {"gapserve.request.num_preemptions": 2}) in events
    assert [name for name, _ in events].count("resumed") == 1
    warnings = [line for line in out.logs() if line["level"] == "warning"]
    assert [w["preemptions_total"] for w in warnings] == [1]  # the first is logged
    assert all(w["request_id"] == "b" and w["service"] == "scheduler" for w in warnings)
    text = warnings[0]["event"]
    for phrase in ("preempted by recomputation", "KV cache", "--max-num-seqs",
                   "--max-num-batched-tokens", "--gpu-memory-utilization"):
        assert phrase in text
    assert sample("gapserve:request_preemptions_count", model_name="preempt-test") == 1
    assert sample("gapserve:request_preemptions_sum", model_name="preempt-test") == 2


def test_preemption_warning_is_logged_for_the_first_and_every_50th(captured):
    out = captured("scheduler")
    tel = telemetry(model="preempt-rate")
    for i in range(120):
        tel.step_scheduled(new_step(i, preempted=[f"r{i}"]),
                           Stats(num_waiting=1, num_preemptions_total=i + 1))
    warnings = [line for line in out.logs() if line["level"] == "warning"]
    assert [w["preemptions_total"] for w in warnings] == [1, 50, 100]
    assert [w["request_id"] for w in warnings] == ["r0", "r49", "r99"]


def test_gauges_follow_stats_and_kv_usage_returns_to_zero_when_idle(captured):
    captured("scheduler")
    tel = telemetry(model="gauges")
    tel.step_scheduled(new_step(1), Stats(num_running=3, num_waiting=2, num_waiting_not_ready=1,
                                          kv_usage=0.75))
    assert sample("gapserve:num_requests_running", model_name="gauges") == 3
    assert sample("gapserve:num_requests_waiting", model_name="gauges") == 2
    assert sample("gapserve:num_requests_waiting_by_reason", model_name="gauges",
                  reason="capacity") == 1
    assert sample("gapserve:num_requests_waiting_by_reason", model_name="gauges",
                  reason="not_ready") == 1
    assert sample("gapserve:kv_cache_usage_perc", model_name="gauges") == 0.75
    tel.status(Stats())  # idle: no step runs, the status query refreshes
    assert sample("gapserve:kv_cache_usage_perc", model_name="gauges") == 0.0
    assert sample("gapserve:num_requests_running", model_name="gauges") == 0


def test_prefix_cache_counters_rise_by_the_difference_of_cumulative_stats(captured):
    captured("scheduler")
    tel = telemetry(model="prefix")
    tel.step_scheduled(new_step(1), Stats(prefix_cache_queries=32, prefix_cache_hits=16))
    tel.step_scheduled(new_step(2), Stats(prefix_cache_queries=48, prefix_cache_hits=16))
    assert sample("gapserve:prefix_cache_queries_total", model_name="prefix") == 48
    assert sample("gapserve:prefix_cache_hits_total", model_name="prefix") == 16


def test_tokens_per_step_and_step_duration_are_observed(captured):
    captured("scheduler")
    clock = Clock()
    tel = telemetry(model="steps", clock=clock)
    tel.step_scheduled(new_step(1, new=["x"], tokens=40), Stats(num_running=1))
    clock.now += 0.02
    tel.step_finished(1, ModelRunnerOutput(1))
    assert sample("gapserve:iteration_tokens_total_sum", model_name="steps") == 40
    assert sample("gapserve:step_duration_seconds_sum", model_name="steps") == \
        __import__("pytest").approx(0.02)


def test_diagnosis_metric_flips_to_past_capacity_and_back(captured):
    captured("scheduler")
    clock = Clock()
    tel = telemetry(model="diag", clock=clock, diagnosis_window_s=5.0)

    def state() -> str:
        return next(d for d in ("healthy", "concurrency_capped", "memory_capped",
                                "budget_capped", "past_capacity")
                    if sample("gapserve:capacity_diagnosis", model_name="diag", diagnosis=d))

    tel.status(Stats(num_running=1))
    assert state() == "healthy"
    clock.now += 1
    tel.step_scheduled(new_step(1, cached=["a"], preempted=["b"]),
                       Stats(num_running=1, num_waiting=1, num_preemptions_total=1, kv_usage=1))
    assert state() == "past_capacity"
    waiting = Stats(num_running=1, num_waiting=1, num_preemptions_total=1,
                    admission_blocked_by="kv_cache")
    assert tel.status(waiting)["diagnosis"] == "past_capacity"
    clock.now += 6
    assert tel.status(waiting)["diagnosis"] == "memory_capped"
    status = tel.status(Stats(num_preemptions_total=1))
    assert status["diagnosis"] == "healthy" and state() == "healthy"


def test_step_carrier_makes_worker_spans_children_of_the_step(captured):
    out = captured("scheduler")
    tel = telemetry()
    carrier = tel.step_scheduled(new_step(1), Stats())
    get_tracer("w").start_span("worker.step", context=extract_context(carrier)).end()
    tel.step_finished(1, None)
    [step] = out.spans("scheduler.step")
    [worker] = out.spans("worker.step")
    assert worker.parent.span_id == step.context.span_id
    assert step.status.status_code == trace.StatusCode.ERROR  # a dropped step says so


def test_request_carrier_puts_worker_spans_in_the_request_trace(captured):
    out = captured("scheduler")
    tel = telemetry()
    tel.request_added("a", 3, SamplingParams())
    carrier = tel.request_carrier("a")
    tel.request_finished("a", FinishReason.ABORT)
    [req] = out.spans("scheduler.request")
    parent = trace.get_current_span(extract_context(carrier)).get_span_context()
    assert parent.span_id == req.context.span_id
    assert tel.request_carrier("unknown") == {}


def test_step_links_put_changed_requests_first_and_count_those_past_the_limit(captured):
    out = captured("scheduler")
    tel = telemetry(max_step_links=2)
    for rid in ("a", "b", "c", "d"):
        tel.request_added(rid, 3, SamplingParams())
    tel.step_scheduled(new_step(1, new=["a", "b", "c"]), Stats(num_running=3))
    tel.step_scheduled(new_step(2, new=["d"], cached=["a", "b"], preempted=["c"]),
                       Stats(num_running=3, num_waiting=1))
    for step_id in (1, 2):
        tel.step_finished(step_id, None)
    spans = {s.attributes["gapserve.step.id"]: s for s in out.spans("scheduler.step")}
    for rid in ("a", "b", "c", "d"):
        tel.request_finished(rid, FinishReason.ABORT)
    req_span = {s.attributes["gen_ai.request.id"]: s.context.span_id
                for s in out.spans("scheduler.request")}
    linked = [link.context.span_id for link in spans[2].links]
    assert linked == [req_span["d"], req_span["c"]]  # the new one and the preempted one
    assert spans[2].attributes["gapserve.step.num_links_dropped"] == 2
    assert len(spans[1].links) == 2
