"""Issue 28 item 4: SIGTERM drains a frontend without cutting a stream. /ready
turns 503 at once while /health stays 200 and the port stays open, new requests
get 503 with Retry-After, a stream still running at --drain-timeout-s ends with an
OpenAI-shaped error event and [DONE] (a gRPC stream with UNAVAILABLE, a new gRPC
Generate is refused with UNAVAILABLE), and the frontend exits with one log line for
the drain, no traceback."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import httpx
import pytest

from shared.proto import common_pb2, generate_pb2
from tests.integration.conftest import TINY_FLAGS, start_stack

DRAIN_S = 3.0
LONG = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "temperature": 0.0,
        "stream": True}


@pytest.fixture
def stack(tiny_model_dir, tmp_path):
    stack = start_stack(tiny_model_dir, tmp_path / "drain-stack",
                        flags=[*TINY_FLAGS, "--max-model-len", "1024",
                               "--drain-timeout-s", str(DRAIN_S)])
    yield stack
    worker = stack.process("worker")
    if worker.poll() is None:
        os.kill(worker.pid, signal.SIGCONT)
    stack.stop()


def wait_draining(stack, timeout_s: float = 10.0) -> httpx.Response:
    """Poll /ready until the frontend has taken the signal (503), or fail."""
    deadline = time.monotonic() + timeout_s
    while (ready := httpx.get(stack.http_url + "/ready", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "/ready never turned 503 after SIGTERM"
        time.sleep(0.01)
    return ready


def events(lines):
    """The `data:` payloads of an SSE stream, parsed ([DONE] as the string)."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


GRPC_LONG = generate_pb2.GenerateRequest(
    token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
    sampling_params=common_pb2.SamplingParams(max_tokens=1000, ignore_eos=True))


def test_sigterm_keeps_serving_open_streams_and_ends_the_last_one_with_an_error_event(stack):
    frontend, worker = stack.process("frontend"), stack.process("worker")
    stub = stack.generation_stub()
    grpc_running = stub.Generate(GRPC_LONG, timeout=60)
    next(grpc_running)  # a gRPC stream runs too
    with httpx.Client(base_url=stack.http_url, timeout=60) as client, \
            client.stream("POST", "/v1/completions", json=LONG) as reply:
        assert reply.status_code == 200
        stream = events(reply.iter_lines())
        assert "choices" in next(stream)
        frontend.send_signal(signal.SIGTERM)
        # the stream goes on after SIGTERM: tokens still arrive
        for _ in range(3):
            assert next(stream)["choices"][0]["text"] is not None
        # hold the stream open past the deadline: the worker stops answering steps
        os.kill(worker.pid, signal.SIGSTOP)
        ready = wait_draining(stack)
        assert ready.status_code == 503 and "shutting down" in ready.json()["error"]["message"]
        with httpx.Client(base_url=stack.http_url, timeout=10) as probe:
            assert probe.get("/health").status_code == 200  # alive: do not kill it
            refused = probe.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
            # Anthropic's Messages route is refused in Anthropic's shape
            refused = probe.post("/v1/messages", json={"max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}]})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["type"] == "error"
            assert refused.json()["error"]["type"] == "overloaded_error"
        with pytest.raises(grpc.RpcError) as grpc_refused:
            next(stub.Generate(GRPC_LONG, timeout=10))
        assert grpc_refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in grpc_refused.value.details()
        rest = list(stream)  # ends at the drain deadline, not with a cut connection
    assert rest[-1] == "[DONE]"
    error = rest[-2]["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503
    assert "drain timeout" in error["message"] and set(error) == {"message", "type",
                                                                   "param", "code"}
    with pytest.raises(grpc.RpcError) as grpc_ended:
        for _ in grpc_running:
            pass
    assert grpc_ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "drain timeout" in grpc_ended.value.details()
    assert frontend.wait(30) == 0
    log = (stack.log_dir / "frontend.log").read_text()
    assert log.count('"draining"') == 1 and log.count('"drained"') == 1, log[-2000:]
    assert "Traceback" not in log and "Cancel" not in log, log[-2000:]
