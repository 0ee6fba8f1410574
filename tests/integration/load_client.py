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
from dataclasses import dataclass

PROBER = r"""
import json, os, socket, sys, time
host, port, period, pid = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
tick = os.sysconf("SC_CLK_TCK")
def loop_cpu_s():  # the server's main thread, where its event loop runs
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick  # utime + stime
probes = []
sys.stdout.write("ready\n"); sys.stdout.flush()
import select
at_least = None  # probes to reach before stopping, once asked to stop
while at_least is None or len(probes) < at_least:
    if at_least is None and select.select([sys.stdin], [], [], 0)[0]:
        at_least = int(sys.stdin.readline())
        continue
    t0, c0 = time.perf_counter(), loop_cpu_s()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    probes.append((time.perf_counter() - t0, loop_cpu_s() - c0))
    assert data.startswith(b"HTTP/1.1 200"), data[:100]
    time.sleep(period)
print(json.dumps(probes))
"""


@dataclass(slots=True)
class Probe:
    wall_s: float      # the probe's latency
    loop_cpu_s: float  # CPU the server's event-loop thread spent while it waited


class HealthProber:
    """Probes GET /health every `period_s` from another process until stopped. With
    each latency it records the CPU time the server's event-loop thread (its main
    thread, process `pid`) used meanwhile: the work queued ahead of /health, which
    does not grow when a loaded machine only delays the server."""

    def __init__(self, host: str, port: int, pid: int, period_s: float = 0.01) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PROBER, host, str(port),
                                      str(period_s), str(pid)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def stop(self, at_least: int = 0) -> list[Probe]:
        """Stops once at least `at_least` probes were made; every probe."""
        out, _ = self.proc.communicate(input=f"{at_least}\n", timeout=300)
        assert self.proc.returncode == 0, out
        return [Probe(*p) for p in json.loads(out)]


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
    /health probes, peak RSS growth)."""
    prober = HealthProber(host, port, pid)
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
