"""The /health prober's stall measure (tests/integration/load_client.py): a probe
that waits behind CPU work on the server's event loop records that work as the loop
thread's CPU time, whatever the machine's load does to its wall time."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.integration.load_client import HealthProber
from tests.ports import free_ports

# a server whose loop answers /health at once, except that POST /stall burns CPU on
# the loop for `seconds` of its own CPU time first
SERVER = r"""
import asyncio, sys, time
port = int(sys.argv[1])
async def handle(reader, writer):
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"POST /stall"):
        end = time.thread_time() + float(head.split(b"?s=")[1].split(b" ")[0])
        while time.thread_time() < end:
            pass
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def test_a_stalled_loop_shows_as_its_cpu_time_in_the_probe_that_waited():
    port = free_ports(1)[0]
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        prober = HealthProber("127.0.0.1", port, server.pid)
        with socket.create_connection(("127.0.0.1", port)) as s:  # stalls the loop
            s.sendall(b"POST /stall?s=0.6 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 200")
        probes = prober.stop(at_least=20)
    finally:
        server.kill()
        server.wait()
    worst = max(p.loop_cpu_s for p in probes)
    assert worst >= 0.3, probes  # a probe waited behind (part of) the 0.6 s stall
    assert sorted(p.loop_cpu_s for p in probes)[len(probes) // 2] < 0.05  # the others did not
