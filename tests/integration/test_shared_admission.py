"""Issue 28 item 7: the queue bound holds over every frontend. With
--api-server-count N each frontend counts only its own requests, so the scheduler,
which sees all of them, refuses an add beyond max-num-seqs + --max-queued-requests
with RESOURCE_EXHAUSTED, and the frontend answers that with HTTP 429, OpenAI's
error body and Retry-After."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.wire.session_client import SessionClient

MAX_NUM_SEQS, MAX_QUEUED = 1, 2
BOUND = MAX_NUM_SEQS + MAX_QUEUED
# each request runs ~500 steps and only one runs at a time: the bound stays full
# for seconds, far longer than the requests below take to arrive
LONG = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("shared-admission"),
                        flags=[*TINY_FLAGS, "--max-num-seqs", str(MAX_NUM_SEQS),
                               "--max-queued-requests", str(MAX_QUEUED),
                               "--api-server-count", "2"])
    yield stack
    stack.stop()


def open_requests(stack) -> int:
    s = stack.engine_status()
    return s.num_running + s.num_waiting


def wait_open(stack, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while open_requests(stack) != count:
        assert time.monotonic() < deadline, f"{open_requests(stack)} open, not {count}"
        time.sleep(0.02)


def complete(stack, body: dict) -> httpx.Response:
    return httpx.post(stack.http_url + "/v1/completions", json=body, timeout=120)


def test_the_scheduler_refuses_an_add_beyond_the_bound_over_all_its_sessions(stack):
    other = SessionClient(stack.engine_stub())  # another frontend's session
    try:
        for i in range(BOUND):
            other.add(f"fill-{i}", [1, 2, 3], max_tokens=500, ignore_eos=True)
        wait_open(stack, BOUND)
        other.add("one-too-many", [1, 2, 3], max_tokens=4)
        other.wait_ended("one-too-many")
        rejection = other.rejected["one-too-many"]
        assert rejection.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert f"limit {BOUND}" in rejection.status.message

        # this frontend holds none of them, yet the scheduler's bound answers: a 429
        reply = complete(stack, {**LONG, "max_tokens": 4})
        assert reply.status_code == 429, reply.text
        assert reply.headers["retry-after"] == "1"
        error = reply.json()["error"]
        assert error["type"] == "rate_limit_error" and "at capacity" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        other.abort(*(f"fill-{i}" for i in range(BOUND)))
        other.wait_ended(*(f"fill-{i}" for i in range(BOUND)))
    finally:
        other.close()
    wait_open(stack, 0)
    assert complete(stack, {**LONG, "max_tokens": 4}).status_code == 200  # room again


def test_two_frontends_together_admit_the_bound_not_twice_it(stack):
    wait_open(stack, 0)
    start = threading.Barrier(2 * BOUND)
    codes: list[int] = []

    def one() -> None:
        with httpx.Client(timeout=120) as client:  # a connection each: both frontends get some
            start.wait()
            codes.append(client.post(stack.http_url + "/v1/completions", json=LONG).status_code)

    threads = [threading.Thread(target=one) for _ in range(2 * BOUND)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(codes) == [200] * BOUND + [429] * BOUND, codes
