"""Constrained streams across a worker SIGKILL and a scheduler SIGKILL (the tiny model,
gRPC Generate; the fault pattern of tests/integration/test_resilience.py): the new
worker rebuilds each matcher by replaying the output it is resent, the new scheduler
gets continuations whose prompt tail is earlier output, and every stream, greedy or
seeded, ends with STOP on exactly the tokens of the no-fault run, matching its grammar.
The grammars count (30 to 34 items), so a matcher that restarted would not match."""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import grpc
import pytest

from shared.wire.common import sampling_to_proto
from shared.proto import common_pb2, generate_pb2
from shared.structured.spec import StructuredOutputSpec as Spec
from shared.types import SamplingParams
from tests.integration.conftest import TINY_FLAGS, start_stack
from tests.integration.test_resilience import (FAULT_ENV, idle, process_stopped, replace_worker,
                                               wait_until)

NUM_STREAMS = 8
FAULT_AFTER_STEPS = 20
ARRAY = {"type": "array", "minItems": 30, "maxItems": 34,
         "items": {"type": "integer", "minimum": 0, "maximum": 9}}
LARK = 'start: "(" NUM ("," NUM)~30..34 ")"\nNUM: /[0-9]/'
SPECS = [Spec("json", json.dumps(ARRAY), disable_any_whitespace=True), Spec("grammar", LARK)]
PATTERNS = [r"\[[0-9](,[0-9]){29,33}\]", r"\([0-9](,[0-9]){30,34}\)"]


def params(i: int) -> SamplingParams:
    sampling = {"temperature": 0.0} if i % 2 == 0 else \
        {"temperature": 0.8, "seed": 700 + i, "frequency_penalty": 0.3}
    return SamplingParams(max_tokens=150, structured_output=SPECS[i % 4 // 2], **sampling)


class Streams:
    def __init__(self, stack) -> None:
        self.stub = stack.generation_stub()
        self.tokens = [[] for _ in range(NUM_STREAMS)]
        self.text = [""] * NUM_STREAMS
        self.finish = [None] * NUM_STREAMS
        self.errors = []
        self.threads = [threading.Thread(target=self._one, args=(i,), daemon=True)
                        for i in range(NUM_STREAMS)]
        for t in self.threads:
            t.start()

    def _one(self, i: int) -> None:
        request = generate_pb2.GenerateRequest(text=f"Numbers for stream {i}:",
                                               sampling_params=sampling_to_proto(params(i)))
        try:
            for msg in self.stub.Generate(request, timeout=120):
                self.tokens[i].extend(msg.token_ids)
                self.text[i] += msg.text
                if msg.HasField("final"):
                    self.finish[i] = msg.final.finish_reason
        except grpc.RpcError as e:
            self.errors.append(e)

    def join(self) -> None:
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads) and not self.errors, self.errors
        assert self.finish == [common_pb2.FINISH_REASON_STOP] * NUM_STREAMS
        for i, text in enumerate(self.text):
            assert re.fullmatch(PATTERNS[i % 4 // 2], text), (i, text)


@pytest.fixture
def fault_stack(tiny_model_dir, tmp_path):
    stack = start_stack(tiny_model_dir, tmp_path / "stack",
                        flags=[*TINY_FLAGS, "--step-timeout-s", "3"],
                        env={FAULT_ENV: str(FAULT_AFTER_STEPS)})
    try:
        yield stack
    finally:
        worker = stack.process("worker")
        if worker.poll() is None:
            worker.send_signal(signal.SIGCONT)
        stack.stop()


def start_faulty_run(stack) -> Streams:
    run = Streams(stack)
    wait_until(lambda: process_stopped(stack.process("worker").pid), "the worker to stop")
    assert all(f is None for f in run.finish) and min(map(len, run.tokens)) > 0
    return run


def assert_equals_no_fault_run(stack, run: Streams) -> None:
    run.join()
    wait_until(lambda: idle(stack), "the KV pool to be whole again", 10.0)
    reference = Streams(stack)
    reference.join()
    assert run.tokens == reference.tokens


def test_constrained_streams_across_a_worker_sigkill_equal_the_no_fault_run(fault_stack):
    run = start_faulty_run(fault_stack)
    replace_worker(fault_stack)  # each request is resent with its output: replayed
    assert_equals_no_fault_run(fault_stack, run)


def test_constrained_streams_across_a_scheduler_sigkill_equal_the_no_fault_run(fault_stack):
    run = start_faulty_run(fault_stack)
    sup = fault_stack.supervisor
    scheduler = next(c for c in sup.children if c.name == "scheduler")
    scheduler.process.kill()
    scheduler.process.wait()
    os.kill(fault_stack.process("worker").pid, signal.SIGCONT)
    sup.launch(scheduler)  # continuations: the output so far is the prompt's tail
    assert_equals_no_fault_run(fault_stack, run)
