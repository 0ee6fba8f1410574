"""Issue 30 through the HTTP frontend: while a large JSON schema compiles, other
streams keep their pace. On this path the frontend compiles the schema first (on
its grammar pool, to refuse a bad one before queueing), then the scheduler defers
the request while rank 0 compiles it again, so the window from sending it to its
first token holds two compiles in two processes; the other streams' largest token
gap must stay a small part of it (tests/structured/test_grpc_structured.py has the
same check on the gRPC -> scheduler path, rank 0's compile alone)."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx

from tests.structured.test_grpc_structured import Stream, check_pace, wait_decoding


def slow_schema(n: int = 5000) -> dict:
    """About half a second to a second to compile here, at each of the two compiles;
    new to every cache (a random tag in each name)."""
    tag = uuid.uuid4().hex[:6]
    return {"type": "object", "required": [f"f{tag}_{i}" for i in range(n)],
            "properties": {f"f{tag}_{i}": {"type": "string",
                                           "pattern": f"^[a-z]{{{i % 5 + 1},9}}$"}
                           for i in range(n)}}


class HttpStream(Stream):
    """One unconstrained greedy SSE stream of /v1/completions; the arrival time of
    every chunk; it hangs up (aborting its request) once `done` is set."""

    def __init__(self, url: str, i: int, done: threading.Event) -> None:
        super().__init__(None, i)
        self.url, self.done = url, done

    def run(self) -> None:
        body = {"prompt": f"Stream {self.i} says", "max_tokens": 480, "ignore_eos": True,
                "temperature": 0.0, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body,
                              timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        self.arrived()
                    if self.done.is_set():
                        break
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            self.error = e
        finally:
            self.warm.set()


def first_chunk(url: str, schema: dict) -> tuple[float, float, str]:
    """Send a streamed request constrained by `schema`: when it was sent, when its
    first chunk with text came, and that text."""
    body = {"prompt": "Fill the form:", "max_tokens": 12, "temperature": 0.0,
            "stream": True, "structured_outputs": {"json": schema}}
    content = json.dumps(body).encode()  # serialized first: not part of the window
    headers = {"content-type": "application/json"}
    sent = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", content=content, headers=headers,
                      timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                text = json.loads(line[6:])["choices"][0]["text"]
                if text:
                    return sent, time.monotonic(), text
    raise AssertionError("the constrained request sent no text")


def test_other_http_streams_keep_their_pace_while_a_large_schema_compiles(tiny_stack):
    done = threading.Event()
    streams = [HttpStream(tiny_stack.http_url, i, done) for i in range(4)]
    for s in streams:
        s.start()
    try:
        wait_decoding(streams)  # all four are decoding
        sent, first, text = first_chunk(tiny_stack.http_url, slow_schema())
        assert text.startswith("{")
    finally:
        done.set()  # each stream hangs up at its next chunk
        for s in streams:
            s.join(120)
    assert all(s.error is None for s in streams), [s.error for s in streams]
    assert all(s.times[-1] > first for s in streams), \
        "a stream ended before the constrained request's first token"
    check_pace(streams, sent, first)
