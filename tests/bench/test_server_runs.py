"""server_runs: the measuring side_by_side.py, spec_decode.py and stack_ceiling.py
share. A server that dies while starting fails at once with its own exit code, one
that died during the run is not an error of the stop, and each server process's cores
count from its first reading."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .test_serve_bench import _load

runs = _load("server_runs")


def test_a_server_that_exits_while_starting_fails_at_once_with_its_exit_code():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(timeout=30)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        runs.wait_ready("http://127.0.0.1:9/v1", proc, timeout_s=600)


def test_cpu_by_process_counts_each_process_from_its_first_reading():
    ticks = runs.TICKS
    before = {10: ("gapserve worker", 5 * ticks)}
    after = {10: ("gapserve worker", 15 * ticks), 11: ("gapserve frontend", 2 * ticks)}
    cores = runs.cpu_by_process(before, after, wall_s=10.0)
    assert cores == {"10 gapserve worker": 1.0, "11 gapserve frontend": 0.2}


def test_a_server_that_died_during_the_run_reports_its_own_error_not_the_stop():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"],
                            start_new_session=True)
    proc.wait(timeout=30)
    runs.stop(proc)  # its process group is gone: nothing to stop, no ProcessLookupError
    assert proc.returncode == 4
