"""How a service process is told to stop, and how it shows where it is stuck.

SIGTERM or SIGINT sets an Event that the worker's and scheduler's main threads wait
on before they drain. Python runs a signal's handler only in the main thread, and only
when that thread executes bytecode: a signal the kernel delivers to another thread
(any thread not blocking it may take a process-directed signal) leaves an untimed
Event.wait() asleep until something else wakes it. So the main thread waits in short
slices, each ending in the interpreter, which runs the handler that is pending.

SIGUSR1 writes every thread's Python stack to stderr (the service's log), at any time:
`kill -USR1 <pid>` where a process looks stuck (docs/resilience.md).
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading

WAKE_S = 0.5  # the longest a pending SIGTERM waits for the main thread


def stop_on_signals() -> threading.Event:
    """An Event that SIGTERM and SIGINT set (call from the main thread)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_stop(stop: threading.Event) -> None:
    """Block the main thread until stop is set, running pending signal handlers."""
    while not stop.wait(WAKE_S):
        pass


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1: every thread's stack to stderr, the process carrying on."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
