"""A light load client for loopback tests: many concurrent HTTP/1.1 requests on
raw asyncio streams (an HTTP library's per-request cost would make the client,
not the server, the thing measured), and a /health prober in its own process so
that its latencies are the server's, not the load client's event loop's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

PROBER = r"""
import json, socket, sys, time
host, port, period = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
latencies = []
sys.stdout.write("ready\n"); sys.stdout.flush()
import select
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    latencies.append(time.perf_counter() - t0)
    assert data.startswith(b"HTTP/1.1 200"), data[:100]
    time.sleep(period)
print(json.dumps(latencies))
"""


class HealthProber:
    """Probes GET /health every `period_s` from another process until stopped."""

    def __init__(self, host: str, port: int, period_s: float = 0.01) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PROBER, host, str(port),
                                      str(period_s)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> list[float]:
        out, _ = self.proc.communicate(input="stop\n", timeout=30)
        assert self.proc.returncode == 0, out
        return json.loads(out)


def _dechunk(body: bytes) -> bytes:
    out, i = bytearray(), 0
    while True:
        end = body.index(b"\r\n", i)
        size = int(body[i:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2:end + 2 + size]
        i = end + 2 + size + 2


async def post_stream(host: str, port: int, path: str, body: dict,
                      headers: dict[str, str] | None = None) -> tuple[int, str]:
    """(status, concatenated choice text) of one streamed completion; a 200 must
    end with [DONE] and carry no error event."""
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                     f"{extra}\r\n".encode() + payload)
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        return status, rest.decode(errors="replace")
    if b"transfer-encoding: chunked" in head.lower():
        rest = _dechunk(rest)
    text, done = "", False
    for line in rest.decode().split("\n"):
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
    assert done, rest[-200:]
    return 200, text


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def _after(delay_s: float, coro):
    await asyncio.sleep(delay_s)
    return await coro


async def run_load(host: str, port: int, bodies: list[dict], pid: int, timeout_s: float,
                   headers: dict[str, str] | None = None, ramp_s: float = 0.0):
    """Every body as a concurrent stream (their starts spread evenly over ramp_s),
    /health probed throughout, the server's memory sampled; returns (results,
    /health latencies, peak RSS growth)."""
    prober = HealthProber(host, port)
    base = peak = rss_bytes(pid)
    try:
        step = ramp_s / max(len(bodies), 1)
        tasks = [asyncio.create_task(_after(i * step, post_stream(
                     host, port, "/v1/completions", b, headers)))
                 for i, b in enumerate(bodies)]
        pending = set(tasks)
        deadline = time.monotonic() + timeout_s
        while pending:
            assert time.monotonic() < deadline, f"{len(pending)} requests never ended"
            _, pending = await asyncio.wait(pending, timeout=0.05)
            peak = max(peak, rss_bytes(pid))
    finally:
        latencies = prober.stop()
    return [t.result() for t in tasks], latencies, peak - base
