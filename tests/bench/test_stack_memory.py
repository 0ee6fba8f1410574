"""stack_memory finds a stack's processes and sums their memory, never its own."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from .test_serve_bench import _load

memory = _load("stack_memory")


@pytest.fixture
def child():
    marker = f"stack-memory-test-{uuid.uuid4().hex}"
    # Blocks on stdin until the test closes it: alive exactly as long as needed.
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", marker],
                            stdin=subprocess.PIPE)
    yield proc, marker
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_pattern_finds_the_processes_whose_command_line_holds_it(child):
    proc, marker = child
    assert memory.find_pids(match=marker) == [proc.pid]


def test_a_root_pid_brings_its_descendants_but_never_the_measuring_process(child):
    proc, _ = child
    pids = memory.find_pids(roots=[os.getpid()])
    assert proc.pid in pids and os.getpid() not in pids


def test_the_sums_add_up_each_process_memory(child):
    proc, marker = child
    sampler = memory.MemorySampler(match=marker, interval_s=0.05).start()
    report = sampler.stop()
    (only,) = report["processes"]
    assert only["pid"] == proc.pid and only["rss_bytes"] > 1 << 20
    assert report["peak_sum_rss_bytes"] >= only["rss_bytes"] >= only["pss_bytes"] > 0
    assert report["sum_peak_rss_bytes"] == only["peak_rss_bytes"] >= only["rss_bytes"]


def test_a_sampler_needs_something_to_measure():
    with pytest.raises(ValueError, match="pattern or pids"):
        memory.MemorySampler()


def test_each_process_is_named_by_the_gapserve_service_it_runs():
    name = memory.service_name
    assert name("/x/.venv/bin/python -m gapserve serve --port 8080") == "serve"
    assert name("/x/.venv/bin/python -m gapserve worker --port 50054 --rank 1") == "worker-1"
    assert name("/x/.venv/bin/python -m gapserve worker --port 50053") == "worker-0"
    assert name("/usr/local/bin/gapserve frontend --scheduler-address a:1") == "frontend"
    assert name("/opt/llama/bin/llama-server -m x.gguf") == "llama-server"


def test_the_report_gives_rss_by_service_and_their_total():
    procs = [memory.ProcessMemory(1, "python -m gapserve frontend", 100, 90, 120),
             memory.ProcessMemory(2, "python -m gapserve frontend", 50, 40, 60),
             memory.ProcessMemory(3, "python -m gapserve worker --rank 0", 1000, 990, 1100)]
    assert memory.by_service(procs) == {"frontend": 150, "worker-0": 1000}
    assert memory.StackMemory(procs).rss_bytes == 1150


def test_the_pool_filling_prompts_hold_more_tokens_than_the_pool_and_share_no_block():
    prompts = memory.fill_pool_requests(pool_tokens=11632, max_model_len=8192,
                                              vocab_size=49152, max_tokens=8)
    assert all(len(p) == 2048 for p in prompts)
    # one request more than the pool holds at once: together they occupy every block
    assert (len(prompts) - 1) * (2048 + 8) >= 11632
    assert len({tuple(p[:16]) for p in prompts}) == len(prompts)  # no first block in common
    assert all(100 <= t < 49152 for p in prompts for t in p)
    short = memory.fill_pool_requests(pool_tokens=1000, max_model_len=256,
                                            vocab_size=500, max_tokens=8)
    assert all(len(p) == 248 for p in short) and (len(short) - 1) * 256 >= 1000
