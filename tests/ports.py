"""Loopback ports for the services a test starts.

A port is drawn below the kernel's ephemeral range (32768-60999 by default), so an
outgoing connection of this or any other process cannot be holding it, and it comes
with the next SPAN - 1 ports free too: a service family derives ports from one
(`--worker-port` + rank, `--data-parallel-port-stride`), and those must be free as
well. Ports handed out once in this process are never handed out again, so two
stacks of one test session cannot be given the same port while the first still
holds it. Under pytest-xdist each worker draws from its own slice of the range, so
two workers cannot pick the same free port before either binds it."""

from __future__ import annotations

import os
import random
import socket

SPAN = 8                      # rank r of a TP group listens on worker_port + r (r < 8)
_LOW, _HIGH = 20000, 32700    # below /proc/sys/net/ipv4/ip_local_port_range


def _slice(low: int, high: int) -> tuple[int, int]:
    """This process's share of [low, high): all of it, or one xdist worker's part."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return low, high
    width = (high - low) // count
    index = int(worker[2:])
    return low + index * width, low + (index + 1) * width


_LOW, _HIGH = _slice(_LOW, _HIGH)
_handed_out: set[int] = set()
_random = random.Random()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, span: int = SPAN) -> list[int]:
    """n ports, each with its next span - 1 ports free and none handed out before."""
    out: list[int] = []
    for _ in range(100_000):
        if len(out) == n:
            return out
        base = _random.randrange(_LOW, _HIGH - span)
        run = range(base, base + span)
        if any(p in _handed_out for p in run) or not all(_bindable(p) for p in run):
            continue
        _handed_out.update(run)
        out.append(base)
    raise RuntimeError(f"no {n} free runs of {span} loopback ports in {_LOW}-{_HIGH}")
