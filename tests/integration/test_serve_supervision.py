"""`gapserve serve` tells why it stopped in its last line: the failed child's own
refusal with the flags that fix it (a worker's, even when the scheduler fails after
it), and a child that keeps dying is restarted with backoff, then given up on
(gapserve/supervisor.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from gapserve import supervisor
from shared import config
from tests.integration.serve_process import start_serve
from tests.integration.test_services import _children
from tests.wire.session_client import wait_for


def _with_model_type(model_dir: Path, out: Path, model_type: str) -> Path:
    """A copy of the checkpoint whose config.json names another model_type."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["model_type"] = model_type
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_restart_delay_doubles_from_half_a_second_up_to_its_cap():
    assert [supervisor.restart_delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert supervisor.restart_delay(50) == supervisor.RESTART_BACKOFF_MAX_S


@pytest.mark.parametrize("attempt", range(3))  # the order of the exits varied (issue 38)
def test_a_worker_refusing_an_unsupported_model_type_is_the_last_line(
        tiny_model_dir, tmp_path, attempt):
    model = _with_model_type(tiny_model_dir, tmp_path / "model", "gpt2")
    serve = start_serve(model, tmp_path / "serve.log")
    try:
        assert serve.wait() == 1
    finally:
        serve.stop()
    lines = serve.lines()
    assert lines[-1].startswith("gapserve worker: unsupported model_type 'gpt2'"), lines
    assert not any(line.startswith("gapserve: serving") for line in lines)
    assert not any("restarting" in line for line in lines)


def test_a_kv_cache_too_small_for_max_model_len_is_the_last_line_naming_both_flags(
        tiny_model_dir, tmp_path):
    serve = start_serve(tiny_model_dir, tmp_path / "serve.log", "--kv-cache-memory", "4096")
    try:
        assert serve.wait() == 1
    finally:
        serve.stop()
    last = serve.lines()[-1]
    assert last.startswith("gapserve worker: the KV cache holds "), serve.lines()
    assert "less than one sequence of --max-model-len 512" in last
    assert last.endswith("lower --max-model-len or raise --kv-cache-memory")


# The first restart delay this test runs with (GAPSERVE_RESTART_BACKOFF_S): the rule,
# doubling per failure, is the same as from the default 0.5 s (the test above), and
# the four delays take 1.5 s instead of 7.5.
FIRST_DELAY_S = 0.1


def test_a_worker_that_keeps_dying_is_restarted_with_backoff_then_given_up_on(
        tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    serve = start_serve(model, tmp_path / "serve.log",
                        env={config.RESTART_BACKOFF_ENV: str(FIRST_DELAY_S)})
    try:
        serve.wait_ready()
        # every restart from now on refuses the checkpoint
        _with_model_type(tiny_model_dir, tmp_path / "refused", "gpt2")
        shutil.copy(tmp_path / "refused" / "config.json", model / "config.json")
        worker = next(k for k in _children(serve.process.pid)
                      if b"worker" in Path(f"/proc/{k}/cmdline").read_bytes())
        os.kill(worker, signal.SIGKILL)
        assert serve.wait() == 1
    finally:
        serve.stop()
    lines = serve.lines()
    delays = [line.rsplit(" in ", 1)[1] for line in lines
              if line.startswith("gapserve serve: worker-0 exited with code")
              and "restarting it" in line]
    assert delays == ["0.1 s", "0.2 s", "0.4 s", "0.8 s"][:supervisor.RESTART_LIMIT - 1]
    assert delays == [f"{supervisor.restart_delay(n, FIRST_DELAY_S):g} s"
                      for n in range(1, supervisor.RESTART_LIMIT)]
    assert lines[-2] == (f"gapserve serve: worker-0 exited {supervisor.RESTART_LIMIT} times "
                         f"within {supervisor.RESTART_WINDOW_S:.0f} s (last with code 2); "
                         f"giving up and stopping")
    assert lines[-1].startswith("gapserve worker: unsupported model_type 'gpt2'"), lines
    assert not _children(serve.process.pid)


def test_the_child_that_said_why_first_is_the_cause_at_start_up():
    """No processes: a worker refuses, then its scheduler loses it; or the scheduler
    fails on its own while the others are stopped by serve."""
    import subprocess

    def child(name: str, code: int, error: str = "", at: float = 0.0,
              signalled: bool = False):
        c = supervisor.Child(name, [], "127.0.0.1:1")
        c.process = subprocess.Popen(["true"])
        c.process.wait()
        c.process.returncode, c.last_error, c.error_at = code, error, at
        c.signalled = signalled
        return c

    worker = child("worker-0", 2, "gapserve worker: unsupported model_type 'gpt2'", at=1.0)
    scheduler = child("scheduler", 2, "gapserve scheduler: worker handshake failed", at=2.0)
    frontend = child("frontend", -15, signalled=True)
    assert supervisor.Supervisor([scheduler, worker, frontend]).cause() is worker
    stopped = child("worker-0", -15, signalled=True)
    assert supervisor.Supervisor([stopped, scheduler, frontend]).cause() is scheduler
    crashed = child("worker-0", -9)  # killed by someone else: it said nothing
    assert supervisor.Supervisor([crashed, frontend]).cause() is crashed
    assert supervisor.Supervisor([stopped, frontend]).cause() is None
