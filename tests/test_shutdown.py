"""shared/shutdown.py: a SIGTERM reaches a service's waiting main thread whichever
thread the kernel delivered it to, and SIGUSR1 dumps every thread's stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIVENESS_S = 60  # a bound on a hang, not a speed: the fix answers within WAKE_S


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=LIVENESS_S)


def test_sigterm_delivered_to_another_thread_ends_the_wait():
    # pthread_kill puts the signal on the helper thread: the C handler runs there and
    # the main thread, asleep in its wait, is not interrupted. An untimed Event.wait()
    # would sleep on (the run times out); wait_for_stop wakes and runs the handler.
    result = run("""
import signal, sys, threading, time
from shared.shutdown import stop_on_signals, wait_for_stop
stop = stop_on_signals()
main = threading.main_thread()
def asleep() -> bool:  # the main thread inside Condition.wait, sleeping in the kernel
    frame = sys._current_frames().get(main.ident)
    state = open(f"/proc/self/task/{main.native_id}/stat").read().rsplit(")", 1)[1].split()[0]
    return frame is not None and frame.f_code.co_name == "wait" and state == "S"
def deliver():
    while not asleep():
        time.sleep(0.01)  # polling for the main thread's state, not a timing guess
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
threading.Thread(target=deliver).start()
wait_for_stop(stop)
print("stopped", stop.is_set())
""")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "stopped True"


def test_sigusr1_writes_every_threads_stack_and_the_process_carries_on():
    result = run("""
import os, signal, threading
from shared.shutdown import dump_stacks_on_sigusr1
dump_stacks_on_sigusr1()
entered, release = threading.Event(), threading.Event()
def parked_in_a_named_function():
    entered.set()
    release.wait()
t = threading.Thread(target=parked_in_a_named_function)
t.start()
entered.wait()
os.kill(os.getpid(), signal.SIGUSR1)
release.set(); t.join()
print("carried on")
""")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "carried on"
    assert "most recent call first" in result.stderr
    assert "parked_in_a_named_function" in result.stderr
