"""A client that goes away mid-request aborts it: HTTP streaming and non-streaming
disconnects and a gRPC cancel each end the request at the scheduler long before
it would have finished, and the KV pool returns to fully free."""

from __future__ import annotations

import json
import socket
import time

import httpx

from shared.proto import generate_pb2

LONG = 400  # tokens: the tiny model needs seconds for these, a disconnect takes one step
BODY = {"prompt": "The quick brown fox", "max_tokens": LONG, "temperature": 0.0,
        "ignore_eos": True}


def status(stack) -> dict:
    return httpx.get(stack.http_url + "/v1/status").json()


def wait_for(stack, predicate, timeout_s: float = 30.0) -> dict:
    """Poll the scheduler's live status until predicate holds (or fail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = status(stack)
        if predicate(current):
            return current
        assert time.monotonic() < deadline, f"status never satisfied the condition: {current}"
        time.sleep(0.02)


def idle(s: dict) -> bool:
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0


def running(s: dict) -> bool:
    return s["num_running"] >= 1


def cancelled_count(stack) -> float:
    for line in httpx.get(stack.http_url + "/metrics").text.splitlines():
        if line.startswith("gapserve:request_errors_total{") and 'code="CANCELLED"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_aborted_early(stack, before: dict, cancelled_before: float) -> None:
    after = wait_for(stack, idle)
    assert after["num_free_blocks"] == before["num_free_blocks"]  # the pool is whole again
    assert after["num_steps_total"] - before["num_steps_total"] < LONG // 2
    assert cancelled_count(stack) == cancelled_before + 1


def test_http_stream_disconnect_aborts_the_request(tiny_stack):
    before, cancelled = wait_for(tiny_stack, idle), cancelled_count(tiny_stack)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", tiny_stack.http_url + "/v1/completions",
                           json={**BODY, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            wait_for(tiny_stack, running)
        # leaving the block closes the connection mid-stream
    assert_aborted_early(tiny_stack, before, cancelled)


def test_http_non_streaming_disconnect_aborts_the_request(tiny_stack):
    before, cancelled = wait_for(tiny_stack, idle), cancelled_count(tiny_stack)
    body = json.dumps(BODY).encode()
    with socket.create_connection(("127.0.0.1", tiny_stack.http_port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(tiny_stack, running)
    assert_aborted_early(tiny_stack, before, cancelled)


def test_grpc_cancel_aborts_the_request(tiny_stack):
    before, cancelled = wait_for(tiny_stack, idle), cancelled_count(tiny_stack)
    stub = tiny_stack.generation_stub()
    call = stub.Generate(generate_pb2.GenerateRequest(text="The quick brown fox", sampling_params={
        "max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}), timeout=60)
    next(call)
    call.cancel()
    assert_aborted_early(tiny_stack, before, cancelled)


def test_other_requests_finish_correctly_around_a_disconnect(tiny_stack):
    client, model = tiny_stack.openai(), tiny_stack.served_model_name
    expected = client.completions.create(model=model, prompt="Hello", max_tokens=20,
                                         temperature=0.0).choices[0].text
    before = wait_for(tiny_stack, idle)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", tiny_stack.http_url + "/v1/completions",
                         json={**BODY, "stream": True}) as response:
            next(line for line in response.iter_lines() if line.startswith("data:"))
            other = client.completions.create(model=model, prompt="Hello", max_tokens=20,
                                              temperature=0.0)
    assert other.choices[0].text == expected
    after = wait_for(tiny_stack, idle)
    assert after["num_free_blocks"] == before["num_free_blocks"]


def test_a_stop_string_aborts_the_request_at_the_scheduler(tiny_stack):
    client, model = tiny_stack.openai(), tiny_stack.served_model_name
    early = client.completions.create(model=model, prompt=BODY["prompt"], max_tokens=10,
                                      temperature=0.0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stop = early[-4:]
    before = wait_for(tiny_stack, idle)
    out = client.completions.create(model=model, prompt=BODY["prompt"], max_tokens=LONG,
                                     temperature=0.0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens <= 10
    after = wait_for(tiny_stack, idle)
    assert after["num_free_blocks"] == before["num_free_blocks"]
    assert after["num_steps_total"] - before["num_steps_total"] < LONG // 2
