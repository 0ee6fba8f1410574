"""The one thread of a worker process that runs torch.

torch's CPU kernels run their parallel regions on OpenMP (libgomp) thread teams, and
a team belongs to the thread that started it. Once two threads of a process have
started teams (say the main thread loaded the weights and a per-stream thread runs
the steps), libgomp counts more threads than cores and stops spinning between
parallel regions: every matrix multiply then waits for its sibling thread to wake
from a futex. On 2 cores that made a batch-1 decode step 41 ms instead of 35 ms.
So the worker loads its model, runs every step and drops requests on this one
long-lived thread, and no other thread of the process calls into torch's kernels.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-compute")
        return _pool


class ComputeThreadStopped(RuntimeError):
    """The interpreter is exiting and the compute thread takes no more work."""


def submit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """Run fn on the compute thread, after everything submitted before it."""
    try:
        return _executor().submit(fn, *args, **kwargs)
    except RuntimeError as e:  # concurrent.futures refuses work once exit has begun
        raise ComputeThreadStopped(str(e)) from e


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run fn on the compute thread and wait for its result (or its exception)."""
    if on_compute_thread():
        return fn(*args, **kwargs)  # already there: waiting on ourselves would deadlock
    return submit(fn, *args, **kwargs).result()


def on_compute_thread() -> bool:
    return threading.current_thread().name.startswith("torch-compute")
