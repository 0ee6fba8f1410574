"""Resilience across the split (docs/resilience.md): a worker that dies or freezes
mid-stream loses no request. 16 concurrent greedy streams of 64 tokens; the worker
stops itself after a fixed number of steps (GAPSERVE_FAULT_STOP_AFTER_STEPS, so the
fault lands mid-stream on any machine speed), then is killed and replaced on the
same port, or resumed after the step watchdog gave it up. Every stream completes
with finish_reason length and exactly the text of the no-fault run from the same
stack, and the KV pool is whole again. The same holds when the scheduler is killed
and restarted mid-stream: the frontend re-submits each open request as its
continuation, and when the worker is killed for good with a spare worker listed
after ';' in --worker-addresses: the scheduler fails over to the spare. Seeded
streams at temperature 0.8 with frequency/presence penalties are likewise the text
of the no-fault run across a worker SIGKILL and a scheduler SIGKILL."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from shared.grpc_server import check_health
from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.ports import free_ports

NUM_STREAMS = 16
MAX_TOKENS = 64
FAULT_AFTER_STEPS = 20
STEP_TIMEOUT_S = 3.0
PROMPTS = [f"Request {i}: the weather in city number {i} is" for i in range(NUM_STREAMS)]


def greedy(i: int) -> dict:
    return {"temperature": 0.0}


def seeded(base: int):
    """Stream i's sampling: temperature 0.8, seed base + i, penalties that count output."""
    return lambda i: {"temperature": 0.8, "seed": base + i, "frequency_penalty": 0.5,
                      "presence_penalty": 0.5}


class Streams:
    """NUM_STREAMS concurrent streaming completions on threads (the openai client)."""

    def __init__(self, stack, sampling=greedy, max_tokens: int = MAX_TOKENS) -> None:
        self.client = stack.openai(timeout=120.0)
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.chunks = [0] * NUM_STREAMS
        self.text = [""] * NUM_STREAMS
        self.finish = [None] * NUM_STREAMS
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._one, args=(i,), daemon=True)
                        for i in range(NUM_STREAMS)]
        self._model = stack.served_model_name
        for t in self.threads:
            t.start()

    def _one(self, i: int) -> None:
        try:
            stream = self.client.completions.create(
                model=self._model, prompt=PROMPTS[i], max_tokens=self.max_tokens,
                stream=True, extra_body={"ignore_eos": True}, **self.sampling(i))
            for chunk in stream:
                choice = chunk.choices[0]
                self.text[i] += choice.text
                self.chunks[i] += 1
                if choice.finish_reason is not None:
                    self.finish[i] = choice.finish_reason
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.errors.append(e)

    def join(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), f"streams hung: {self.chunks}"
        assert not self.errors, self.errors


def wait_until(predicate, what: str, timeout_s: float = 60.0, explain=None):
    """explain(): more for the failure's message, e.g. a stuck service's stacks."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}"
                                 + (f"\n{explain()}" if explain is not None else ""))
        time.sleep(0.01)
    return value


def stacks(process, log: Path) -> str:
    """A service's every thread's stack (SIGUSR1, shared/shutdown.py), from its log;
    for a failure's message only."""
    start = log.stat().st_size
    process.send_signal(signal.SIGUSR1)
    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline:
        time.sleep(0.2)
        grown = log.read_bytes()[start:].decode(errors="replace")
        if "most recent call first" in grown and grown == text:
            break  # written and no longer growing
        text = grown
    return text or "(no stacks written)"


def process_stopped(pid: int) -> bool:
    """True once the process is in state T (stopped by a signal)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0] in ("T", "t")


def scheduler_metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def idle(stack) -> bool:
    s = httpx.get(stack.http_url + "/v1/status").json()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0


FAULT_ENV = "GAPSERVE_FAULT_STOP_AFTER_STEPS"


@pytest.fixture
def fault_stack(tiny_model_dir, tmp_path):
    """A stack whose worker stops itself after FAULT_AFTER_STEPS steps."""
    (metrics_port,) = free_ports(1)
    stack = start_stack(tiny_model_dir, tmp_path / "stack", flags=[
        *TINY_FLAGS, "--step-timeout-s", str(STEP_TIMEOUT_S),
        "--scheduler-metrics-port", str(metrics_port)],
        env={FAULT_ENV: str(FAULT_AFTER_STEPS)})
    try:
        yield stack, metrics_port
    finally:
        worker = stack.process("worker")
        if worker.poll() is None:
            worker.send_signal(signal.SIGCONT)  # a stopped process cannot take its SIGTERM
        stack.stop()


def replace_worker(stack) -> None:
    """SIGKILL the worker and start a new one (without the fault) on the same port,
    as a restarted container would be."""
    sup = stack.supervisor
    child = next(c for c in sup.children if c.name.startswith("worker"))
    child.process.kill()
    child.process.wait()
    sup.launch(child, env={k: v for k, v in sup.env.items() if k != FAULT_ENV})


def start_faulty_run(stack, sampling=greedy, max_tokens: int = MAX_TOKENS) -> Streams:
    """16 streams; returns once the worker has stopped itself mid-stream."""
    run = Streams(stack, sampling, max_tokens)
    wait_until(lambda: process_stopped(stack.process("worker").pid), "the worker to stop")
    # every request reached the scheduler (a thread may start late on a busy machine)
    wait_until(lambda: (lambda s: s["num_running"] + s["num_waiting"])(
        httpx.get(stack.http_url + "/v1/status", timeout=30).json()) == NUM_STREAMS,
        "all requests at the scheduler")
    assert min(run.chunks) < max_tokens and run.finish.count(None) == NUM_STREAMS
    return run


def assert_recovered(stack, metrics_port: int, run: Streams, sampling=greedy) -> None:
    """Every stream ends with length and the text of a no-fault run from the same stack."""
    run.join()
    assert run.finish == ["length"] * NUM_STREAMS
    wait_until(lambda: idle(stack), "the KV pool to be whole again", 10.0)
    assert scheduler_metric(metrics_port, "gapserve:worker_reconnects_total") >= 1
    assert scheduler_metric(metrics_port, "gapserve:requests_recovered_total") >= 1
    assert check_health(stack.scheduler_address)  # SERVING again
    wait_until(lambda: httpx.get(stack.http_url + "/ready").status_code == 200, "ready")
    reference = Streams(stack, sampling, run.max_tokens)  # no fault now
    reference.join()
    assert reference.finish == ["length"] * NUM_STREAMS
    assert run.text == reference.text  # greedy or seeded: identical to the no-fault run


def test_worker_sigkill_mid_stream_loses_no_request(fault_stack):
    stack, metrics_port = fault_stack
    run = start_faulty_run(stack)
    replace_worker(stack)
    assert_recovered(stack, metrics_port, run)


def test_worker_sigkill_fails_over_to_the_spare_and_loses_no_request(tiny_model_dir,
                                                                     tmp_path):
    """--worker-addresses "A;B": A dies mid-stream and stays dead; B takes over."""
    spare = start_stack(tiny_model_dir, tmp_path / "spare", services=("worker",),
                        flags=TINY_FLAGS)
    (metrics_port,) = free_ports(1)
    stack = None
    try:
        stack = start_stack(tiny_model_dir, tmp_path / "stack", flags=[
            *TINY_FLAGS, "--scheduler-metrics-port", str(metrics_port)],
            env={FAULT_ENV: str(FAULT_AFTER_STEPS)}, spare_workers=[spare.worker_address])
        assert stack.engine_status().worker_addresses == stack.worker_address
        run = Streams(stack)
        worker = stack.process("worker")
        wait_until(lambda: process_stopped(worker.pid), "the worker to stop mid-stream")
        worker.kill()  # and not restarted: only the spare can take over
        worker.wait()
        run.join()
        assert run.finish == ["length"] * NUM_STREAMS
        wait_until(lambda: idle(stack), "the KV pool to be whole again", 10.0)
        status = stack.engine_status()
        assert status.worker_addresses == spare.worker_address
        assert (status.num_worker_failovers_total, status.num_worker_reconnects_total) == (1, 1)
        assert scheduler_metric(metrics_port, "gapserve:worker_failovers_total") == 1
        assert scheduler_metric(metrics_port, "gapserve:worker_reconnects_total") == 1
        assert scheduler_metric(metrics_port, "gapserve:requests_recovered_total") >= 1
        failover = [line for line in (stack.log_dir / "scheduler.log").read_text().splitlines()
                    if '"worker_failover"' in line]
        assert len(failover) == 1 and spare.worker_address in failover[0]
        reference = Streams(stack)  # no fault now, on the spare
        reference.join()
        assert run.text == reference.text  # greedy: identical to the no-fault run
    finally:
        if stack is not None:
            stack.stop()
        spare.stop()


def test_scheduler_restart_mid_stream_loses_no_request(fault_stack):
    stack, metrics_port = fault_stack
    run = start_faulty_run(stack)  # the worker froze: the streams are mid-way
    sup = stack.supervisor
    scheduler = next(c for c in sup.children if c.name == "scheduler")
    scheduler.process.kill()
    scheduler.process.wait()
    os.kill(stack.process("worker").pid, signal.SIGCONT)  # its Step stream is gone
    sup.launch(scheduler)  # the frontend re-submits every open request to it
    run.join()
    assert run.finish == ["length"] * NUM_STREAMS
    wait_until(lambda: idle(stack), "the KV pool to be whole again", 10.0)
    reference = Streams(stack)
    reference.join()
    assert run.text == reference.text  # greedy: identical to the no-fault run
    metrics = httpx.get(stack.http_url + "/metrics").text
    resumed = [line for line in metrics.splitlines()
               if line.startswith("gapserve:requests_resumed_total{")]
    assert resumed and float(resumed[0].rsplit(" ", 1)[1]) == NUM_STREAMS


def assert_other_seeds_differ(stack, run: Streams) -> None:
    """The equality above can fail: other seeds give every stream other text."""
    other = Streams(stack, seeded(5000))
    other.join()
    assert all(a != b for a, b in zip(run.text, other.text))


def test_seeded_streams_across_a_worker_sigkill_equal_the_no_fault_run(fault_stack):
    stack, metrics_port = fault_stack
    run = start_faulty_run(stack, seeded(1000))
    replace_worker(stack)  # the new worker gets each request with its output so far
    assert_recovered(stack, metrics_port, run, seeded(1000))
    assert_other_seeds_differ(stack, run)


def test_seeded_streams_across_a_scheduler_sigkill_equal_the_no_fault_run(fault_stack):
    stack, _ = fault_stack
    run = start_faulty_run(stack, seeded(1000))
    sup = stack.supervisor
    scheduler = next(c for c in sup.children if c.name == "scheduler")
    scheduler.process.kill()
    scheduler.process.wait()
    os.kill(stack.process("worker").pid, signal.SIGCONT)
    sup.launch(scheduler)  # continuations: output folded into the prompt, and marked so
    run.join()
    assert run.finish == ["length"] * NUM_STREAMS
    wait_until(lambda: idle(stack), "the KV pool to be whole again", 10.0)
    reference = Streams(stack, seeded(1000))
    reference.join()
    assert run.text == reference.text
    assert_other_seeds_differ(stack, run)


def test_worker_sigstop_is_caught_by_the_step_watchdog(fault_stack):
    stack, metrics_port = fault_stack
    run = start_faulty_run(stack)
    # the watchdog gives the frozen worker up: the scheduler says NOT_SERVING
    wait_until(lambda: not check_health(stack.scheduler_address), "NOT_SERVING",
               STEP_TIMEOUT_S + 10)
    assert run.finish.count(None) == NUM_STREAMS  # paused, not failed
    # readiness tells the truth at the frontend too; liveness stays up (it holds requests)
    wait_until(lambda: httpx.get(stack.http_url + "/ready").status_code == 503, "not ready")
    assert httpx.get(stack.http_url + "/v1/models").status_code == 503
    assert httpx.get(stack.http_url + "/health").status_code == 200
    os.kill(stack.process("worker").pid, signal.SIGCONT)  # the same process comes back
    assert_recovered(stack, metrics_port, run)


def test_sigterm_drains_the_scheduler_running_requests_finish_there(fault_stack):
    stack, _ = fault_stack
    run = start_faulty_run(stack)
    sup = stack.supervisor
    scheduler = next(c for c in sup.children if c.name == "scheduler")
    log = stack.log_dir / "scheduler.log"
    scheduler.process.send_signal(signal.SIGTERM)
    wait_until(lambda: b'"draining"' in log.read_bytes(), "the scheduler to start draining",
               explain=lambda: stacks(scheduler.process, log))
    os.kill(stack.process("worker").pid, signal.SIGCONT)
    run.join()  # finished on the draining scheduler, not re-submitted
    assert run.finish == ["length"] * NUM_STREAMS
    assert scheduler.process.wait(30) == 0
    drained = [line for line in log.read_text().splitlines() if '"drained"' in line]
    assert drained and '"unfinished": 0' in drained[-1]
    sup.launch(scheduler)
    wait_until(lambda: httpx.get(stack.http_url + "/ready").status_code == 200, "ready")
    reference = Streams(stack)
    reference.join()
    assert run.text == reference.text
