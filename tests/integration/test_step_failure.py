"""A request that fails by itself (docs/resilience.md): the real stack on the tiny
model, its worker started with GAPSERVE_FAULT_FAIL_ON_TOKEN so that every step
scheduling that token raises. A request holding it gets a clean error (HTTP 500 in
OpenAI's shape, an SSE error event then [DONE], gRPC INTERNAL, each naming the
exception); a greedy stream in flight beside it and requests sent later finish with
transformers' greedy tokens; /health stays 200, the KV pool empties, the failures are
counted apart from successes, and the logs stay small."""

from __future__ import annotations

import json
import threading

import grpc
import httpx
import pytest
import torch

from shared.proto import common_pb2, generate_pb2
from tests.integration.conftest import TINY_FLAGS, free_ports, start_stack
from tests.integration.hf_reference import hf_greedy
from tests.integration.test_resilience import scheduler_metric, wait_until

POISON = 43383  # the tiny model's 4th greedy token after SAMPLED, in no other request
SAMPLED = [1, 300, 301, 302, 303]  # samples the poison token mid-stream
HEALTHY = [1, 504, 3209, 28, 253, 4821, 99]
LATER = [[1, 17, 912, 33, 7], [1, 2048, 3, 77, 610, 5, 9, 41]]
BAD = [1, 504, POISON, 28, 253]  # holds it in its prompt
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def poison_stack(tiny_model_dir, tmp_path_factory):
    (metrics_port,) = free_ports(1)
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("poison-stack"), flags=[
        *TINY_FLAGS, "--scheduler-metrics-port", str(metrics_port)],
        env={"GAPSERVE_FAULT_FAIL_ON_TOKEN": str(POISON)})
    yield stack, metrics_port
    stack.stop()


def grpc_generate(stack, prompt: list[int], max_tokens: int = MAX_TOKENS, on_token=None):
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens = []
    for reply in stack.generation_stub().Generate(request, timeout=120):
        tokens += reply.token_ids
        if on_token is not None and tokens:
            on_token()
    return tokens


def completion(stack, prompt: list[int], **kw) -> httpx.Response:
    return httpx.post(stack.http_url + "/v1/completions", timeout=120, json={
        "model": stack.served_model_name, "prompt": prompt, "max_tokens": 16,
        "temperature": 0.0, "ignore_eos": True, **kw})


def test_a_poison_request_fails_alone_with_a_clear_error_and_everyone_else_is_served(
        poison_stack, hf_tiny):
    stack, metrics_port = poison_stack
    expected = {tuple(p): hf_greedy(hf_tiny, p, MAX_TOKENS) for p in [HEALTHY, *LATER]}
    assert not any(POISON in t for t in expected.values())  # only BAD holds the token
    assert hf_greedy(hf_tiny, SAMPLED, 4)[3] == POISON and POISON not in HEALTHY + sum(LATER, [])

    # a greedy stream in flight while the poison requests fail beside it
    started, beside = threading.Event(), {}
    thread = threading.Thread(target=lambda: beside.update(tokens=grpc_generate(
        stack, HEALTHY, on_token=started.set)), daemon=True)
    thread.start()
    assert started.wait(120), "the healthy stream produced no token"

    reply = completion(stack, BAD)  # not streamed: HTTP 500, OpenAI's error body
    assert reply.status_code == 500, reply.text
    error = reply.json()["error"]
    assert error["type"] == "server_error" and error["code"] == 500
    assert "GAPSERVE_FAULT_FAIL_ON_TOKEN" in error["message"]
    assert "retrying it once" in error["message"]

    # streamed, failing before its first token: the headers are not sent yet, so the
    # answer is the same 500; failing mid-stream: an SSE error event, then [DONE]
    assert completion(stack, BAD, stream=True).status_code == 500
    with httpx.stream("POST", stack.http_url + "/v1/completions", timeout=120, json={
            "model": stack.served_model_name, "prompt": SAMPLED, "max_tokens": 16,
            "temperature": 0.0, "stream": True}) as stream:
        assert stream.status_code == 200
        events = [line[len("data: "):] for line in stream.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = json.loads(events[-2])["error"]
    assert streamed["code"] == 500 and "GAPSERVE_FAULT_FAIL_ON_TOKEN" in streamed["message"]
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert events[:-2]  # the tokens before the poison one were streamed

    with pytest.raises(grpc.RpcError) as failed:  # gRPC: INTERNAL with the message
        grpc_generate(stack, BAD)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "GAPSERVE_FAULT_FAIL_ON_TOKEN" in failed.value.details()

    thread.join(120)
    assert beside["tokens"] == expected[tuple(HEALTHY)]  # recomputed, token-equal
    for prompt in LATER:  # requests sent later are served as if nothing happened
        assert grpc_generate(stack, prompt) == expected[tuple(prompt)]
    assert httpx.get(stack.http_url + "/health").status_code == 200

    def pool_free():
        status = stack.engine_status()
        return status.num_running == 0 and status.num_free_blocks == status.num_kv_blocks - 1
    wait_until(pool_free, "the KV pool to empty")
    assert scheduler_metric(metrics_port, "gapserve:requests_failed_total") == 4
    assert scheduler_metric(metrics_port, "gapserve:steps_failed_total") >= 3
    front = httpx.get(stack.http_url + "/metrics").text
    successes = sum(float(line.rsplit(" ", 1)[1]) for line in front.splitlines()
                    if line.startswith("vllm:request_success_total{"))
    assert successes == 1 + len(LATER)  # the failed ones are errors, not successes
    # one request_failed line per failed request, and kilobytes of log, not megabytes
    logs = {p.name: p.read_text(errors="replace") for p in stack.log_dir.glob("*.log")}
    scheduler_log = next(text for name, text in logs.items() if name.startswith("scheduler"))
    assert scheduler_log.count('"request_failed"') == 4
    assert sum(len(text) for text in logs.values()) < 1 << 20
