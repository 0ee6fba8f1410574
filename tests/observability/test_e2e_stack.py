"""The issue's end-to-end checks on the real stack (three processes, tiny model):
every service exports over OTLP/gRPC to a receiver in this test process, and
serves Prometheus metrics. The KV pool is starved (9 usable blocks of 16 tokens)
so that concurrent requests must preempt."""

from __future__ import annotations

import json
import secrets
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Stack, start_stack
from tests.ports import free_ports
from tests.integration.tiny_model import tiny_llama_dir
from tests.observability.otlp_receiver import OtlpReceiver

PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the fence"


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def stack(receiver, tmp_path_factory):
    sched_metrics, worker_metrics = free_ports(2)
    flags = ["--otlp-traces-endpoint", receiver.endpoint,
             "--num-gpu-blocks-override", "10", "--max-model-len", "128",
             "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
             "--scheduler-metrics-port", str(sched_metrics),
             "--worker-metrics-port", str(worker_metrics)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
        s = start_stack(tiny_llama_dir(), tmp_path_factory.mktemp("observed-stack"),
                        flags=flags)
    try:
        yield ObservedStack(s, f"http://127.0.0.1:{sched_metrics}/metrics",
                            f"http://127.0.0.1:{worker_metrics}/metrics")
    finally:
        s.stop()


@dataclass(slots=True)
class ObservedStack:
    stack: Stack
    scheduler_metrics_url: str
    worker_metrics_url: str

    def __getattr__(self, name):
        return getattr(self.stack, name)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items() - {("model_name", s.labels.get(
        "model_name"))})): s.value for fam in text_string_to_metric_families(body)
            for s in fam.samples}


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def get_json(url: str) -> dict:
    return json.load(urllib.request.urlopen(url, timeout=10))


def complete(stack, max_tokens: int, trace_id: str | None = None, stream: bool = False):
    headers = {}
    if trace_id:
        headers["traceparent"] = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    client = stack.openai()
    kwargs = dict(model=stack.served_model_name, prompt=PROMPT, max_tokens=max_tokens,
                  temperature=0.0, extra_body={"ignore_eos": True}, extra_headers=headers)
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True,
                                                                             **kwargs))
    return client.completions.create(**kwargs).choices[0].text


def test_one_request_is_one_trace_through_frontend_scheduler_and_worker(stack, receiver):
    trace_id = secrets.token_hex(16)
    complete(stack, max_tokens=4, trace_id=trace_id)
    spans = receiver.wait_for(lambda s: {x.service for x in s if x.trace_id == trace_id} >=
                              {"frontend", "scheduler", "worker-0"})
    mine = {s.name: s for s in spans if s.trace_id == trace_id}
    root = mine[f"text_completion {stack.served_model_name}"]
    request = mine["scheduler.request"]
    prefill = mine["worker.prefill"]
    assert root.kind == 2  # SERVER, continuing the caller's trace
    assert request.parent_span_id == root.span_id
    assert prefill.parent_span_id == request.span_id
    assert root.attributes["gen_ai.request.model"] == stack.served_model_name
    assert root.attributes["gen_ai.request.max_tokens"] == 4
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert [e for e, _ in request.events] == ["queued", "first_scheduled", "first_token",
                                              "finished"]
    # each step that served it is its own span, linked to the request, not its parent
    steps = receiver.wait_for(lambda s: sum(
        (trace_id, request.span_id) in x.links for x in s if x.name == "scheduler.step") >= 4)
    served = [s for s in steps if s.name == "scheduler.step"
              and (trace_id, request.span_id) in s.links]
    assert all(s.trace_id != trace_id for s in served)
    step_ids = {s.span_id for s in served}
    workers = receiver.wait_for(lambda s: len(step_ids & {
        x.parent_span_id for x in s if x.name == "worker.step"}) == len(step_ids))
    forward = [s for s in workers if s.name == "worker.forward"]
    assert forward and all(s.service == "worker-0" for s in forward)


def test_grpc_metadata_traceparent_continues_the_callers_trace(stack, receiver):
    from shared.proto import common_pb2, generate_pb2

    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    request = generate_pb2.GenerateRequest(
        text=PROMPT, sampling_params=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
    replies = list(stack.generation_stub().Generate(
        request, metadata=[("traceparent", f"00-{trace_id}-{parent}-01")], timeout=60))
    assert replies[-1].HasField("final")
    spans = receiver.wait_for(lambda s: {x.service for x in s if x.trace_id == trace_id} >=
                              {"frontend", "scheduler", "worker-0"})
    [root] = [s for s in spans if s.trace_id == trace_id and s.service == "frontend"]
    assert root.parent_span_id == parent


def test_an_engine_protocol_request_joins_the_callers_trace_and_the_schedulers_metrics(
        stack, receiver):
    # a gateway (smg) speaking vllm.grpc.engine to the scheduler: the same spans and
    # request metrics as a gapserve frontend's session
    from smg_grpc_proto import vllm_engine_pb2 as pb
    from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

    before = scrape(stack.scheduler_metrics_url)
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    vllm = pb_grpc.VllmEngineStub(stack.channel(stack.scheduler_address))
    [done] = list(vllm.Generate(pb.GenerateRequest(
        request_id="via-engine-protocol", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)),
        metadata=[("traceparent", f"00-{trace_id}-{parent}-01")], timeout=60))
    assert done.complete.completion_tokens == 2
    spans = receiver.wait_for(lambda s: {x.service for x in s if x.trace_id == trace_id} >=
                              {"scheduler", "worker-0"})
    [request] = [s for s in spans if s.trace_id == trace_id and s.name == "scheduler.request"]
    assert request.parent_span_id == parent
    after = scrape(stack.scheduler_metrics_url)
    assert value(after, "gapserve:request_inference_time_seconds_count") - \
        value(before, "gapserve:request_inference_time_seconds_count") == 1
    assert value(after, "gapserve:vllm_engine_rpcs_total", method="Generate", code="OK") - \
        value(before, "gapserve:vllm_engine_rpcs_total", method="Generate", code="OK") == 1


def test_starved_pool_preempts_visibly_in_spans_metrics_logs_and_status(stack, receiver):
    before = scrape(stack.scheduler_metrics_url)
    assert get_json(stack.http_url + "/v1/status")["diagnosis"] == "healthy"
    trace_ids = [secrets.token_hex(16) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:  # 4 x ~100 tokens against a 144-token pool
        list(pool.map(lambda t: complete(stack, 80, t), trace_ids))

    after = scrape(stack.scheduler_metrics_url)
    preempted = (value(after, "gapserve:num_preemptions_total")
                 - value(before, "gapserve:num_preemptions_total"))
    assert preempted >= 1
    assert value(after, "gapserve:request_preemptions_sum") - value(
        before, "gapserve:request_preemptions_sum") == preempted
    # idle again: nothing running, every block free, without asking for status first
    assert value(after, "gapserve:kv_cache_usage_perc") == 0.0
    assert value(after, "gapserve:num_requests_running") == 0.0
    # nothing waits any more: healthy at once, while the window still counts them
    assert value(after, "gapserve:capacity_diagnosis", diagnosis="healthy") == 1.0
    status = get_json(stack.http_url + "/v1/status")
    assert status["diagnosis"] == "healthy"
    assert status["preemption_rate_per_s"] > 0 and status["max_num_seqs"] == 8
    changes = [line for line in log_lines(stack, "scheduler")
               if line.get("event") == "capacity diagnosis changed"]
    assert any(c["diagnosis"] == "past_capacity" for c in changes)  # while they waited

    spans = receiver.wait_for(lambda s: sum(
        x.name == "scheduler.request" and x.trace_id in trace_ids for x in s) == 4)
    events = [attrs for s in spans if s.name == "scheduler.request" and s.trace_id in trace_ids
              for name, attrs in s.events if name == "preempted"]
    assert len(events) == preempted
    assert all(e["gapserve.request.num_preemptions"] >= 1 for e in events)
    recomputed = receiver.wait_for(lambda s: any(
        x.name == "worker.recompute" and x.trace_id in trace_ids for x in s))
    assert any(x.name == "worker.recompute" for x in recomputed)

    total_before = value(before, "gapserve:num_preemptions_total")
    logged = [k for k in range(int(total_before) + 1, int(total_before + preempted) + 1)
              if k == 1 or k % 50 == 0]  # vLLM's rate: the first and every 50th
    warnings = [line for line in log_lines(stack, "scheduler")
                if "preempted by recomputation" in line.get("event", "")
                and line.get("trace_id") in trace_ids]
    assert [w["preemptions_total"] for w in warnings] == logged
    assert all(w["level"] == "warning" and w["request_id"] and w["service"] == "scheduler"
               for w in warnings)


def log_lines(stack, name: str) -> list[dict]:
    text = (stack.log_dir / f"{name}.log").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_frontend_and_worker_metrics_count_every_request(stack):
    url = stack.http_url + "/metrics"
    front, worker = scrape(url), scrape(stack.worker_metrics_url)
    complete(stack, max_tokens=3)
    complete(stack, max_tokens=3, stream=True)
    front2, worker2 = scrape(url), scrape(stack.worker_metrics_url)

    def delta(before, after, name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta(front, front2, "gapserve:time_to_first_token_seconds_count") == 2
    assert delta(front, front2, "gapserve:e2e_request_latency_seconds_count") == 2
    assert delta(front, front2, "gapserve:generation_tokens_total") == 6
    assert delta(front, front2, "gapserve:inter_token_latency_seconds_count") == 4
    assert delta(front, front2, "gapserve:request_success_total", finished_reason="length") == 2
    assert delta(worker, worker2, "gapserve:model_forward_time_milliseconds_count",
                 rank="0") >= 6


def test_every_log_line_of_every_service_is_json_with_the_service(stack):
    for name, service in (("frontend", "frontend"), ("scheduler", "scheduler"),
                          ("worker-0", "worker")):
        lines = log_lines(stack, name)  # raises on any line that is not JSON
        assert lines and all(line["service"].startswith(service) for line in lines)
        assert all("timestamp" in line and "level" in line for line in lines)


def test_gapserve_status_prints_the_live_diagnosis_and_its_lever(stack, capsys):
    from gapserve import status

    assert status.main(["--url", stack.http_url]) == 0
    printed = capsys.readouterr().out
    live = get_json(stack.http_url + "/v1/status")
    assert printed.splitlines()[0] == f"diagnosis: {live['diagnosis']}"
    assert f"lever: {live['lever']}" in printed
