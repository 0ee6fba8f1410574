"""Issue 28 item 7: the queue bound holds over every frontend. With
--api-server-count N each frontend counts only its own requests, so the scheduler,
which sees all of them, refuses an add beyond max-num-seqs + --max-queued-requests
with RESOURCE_EXHAUSTED, and the frontend answers that with HTTP 429, OpenAI's
error body and Retry-After."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path

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


def server_pid(stack, client_port: int) -> int:
    """The frontend process that accepted the loopback connection from client_port:
    the server side's socket inode (/proc/net/tcp: local port = the HTTP port,
    remote port = client_port), found among each frontend's open descriptors."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == stack.http_port and \
                    int(cols[2].rsplit(":", 1)[1], 16) == client_port:
                inodes.add(f"socket:[{cols[9]}]")
    owners = set()
    for child in stack.supervisor.children:
        if child.name.startswith("frontend"):
            fds = Path(f"/proc/{child.process.pid}/fd")
            if any(os.readlink(fd) in inodes for fd in fds.iterdir()):
                owners.add(child.process.pid)
    assert len(owners) == 1, (client_port, inodes, owners)
    return owners.pop()


def connections_to_each_frontend(stack, count: int) -> dict[int, list]:
    """`count` open keep-alive connections to each of the two frontends. The kernel
    picks the frontend of each new connection (SO_REUSEPORT: a hash of the client's
    port); a connection answers /health first, so the frontend has accepted it, then
    its owner is read from /proc and the connection kept if that one needs more."""
    found: dict[int, list] = {}
    spare = []
    for _ in range(200):  # 2 frontends: the chance of missing one is 2**-199
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=120)
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b""
        mine = found.setdefault(server_pid(stack, conn.sock.getsockname()[1]), [])
        (mine if len(mine) < count else spare).append(conn)
        if len(found) == 2 and all(len(c) == count for c in found.values()):
            break
    for conn in spare:
        conn.close()
    assert len(found) == 2 and all(len(c) == count for c in found.values()), found
    return found


def test_two_frontends_together_admit_the_bound_not_twice_it(stack):
    """BOUND requests to each frontend at once: each alone would admit all of its
    own (its bound is BOUND too), so without the scheduler's bound all 2 x BOUND
    would run; with it, BOUND run and BOUND are refused, whichever frontend took
    which. Both frontends demonstrably serve: every connection's owner is known."""
    wait_open(stack, 0)
    by_frontend = connections_to_each_frontend(stack, BOUND)
    start = threading.Barrier(2 * BOUND)
    codes: dict[int, list[int]] = {pid: [] for pid in by_frontend}
    body = json.dumps(LONG)

    def one(pid: int, conn: http.client.HTTPConnection) -> None:
        port = conn.sock.getsockname()[1]
        start.wait()
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        reply = conn.getresponse()
        reply.read()
        # http.client reconnects only a connection it closed itself: this one was open,
        # so the answer came from the frontend found for it (the socket may be closed
        # now, after a refusal)
        assert conn.sock is None or conn.sock.getsockname()[1] == port
        codes[pid].append(reply.status)

    threads = [threading.Thread(target=one, args=(pid, conn))
               for pid, conns in by_frontend.items() for conn in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for conns in by_frontend.values():
        for conn in conns:
            conn.close()
    assert all(len(c) == BOUND for c in codes.values()), codes  # each answered its own
    every = sorted(c for cs in codes.values() for c in cs)
    assert every == [200] * BOUND + [429] * BOUND, codes
