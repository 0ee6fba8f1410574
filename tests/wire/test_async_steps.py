"""Async scheduling across the real Step stream (tiny random-weight model, loopback
gRPC): two steps in flight, the worker fills in its own sampled tokens, and the
in-flight edge cases (a stop, max_tokens, an abort, a preemption) come out exactly
as with one step in flight and as transformers alone."""

from __future__ import annotations

import queue
import threading
import time
import uuid

import pytest
import torch

from shared.wire.worker import scheduler_output_to_proto
from shared.proto import common_pb2, engine_pb2
from shared.types import NewRequestData, SamplingParams, SchedulerOutput
from tests.wire.conftest import start_wire_stack
from tests.wire.session_client import SessionClient, wait_for
from tests.wire.test_engine_service import hf_greedy
from worker_svc import compute
from worker_svc.config import WorkerConfig
from worker_svc.server import _END, StepPipe

PROMPTS = [[1, 504, 3209, 28, 253], [7, 7, 7], list(range(100, 140)), [4821, 99, 3, 17, 5, 8, 1000]]
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


def rid() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def async_stack(tiny_runner):
    stack = start_wire_stack(tiny_runner, async_scheduling=True)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def small_pool_runner(tiny_model_dir):
    """11 usable blocks of 16 tokens: a few 59-token requests must preempt each other."""
    from worker_svc.runner import ModelRunner
    return ModelRunner(WorkerConfig(model=tiny_model_dir, num_gpu_blocks_override=12,
                                    max_model_len=64, max_num_seqs=16))


def record_steps(stack) -> list[SchedulerOutput]:
    """Every step the engine submits, in order (the real group still runs each)."""
    seen: list[SchedulerOutput] = []
    submit = stack.group.submit

    def recording(step: SchedulerOutput) -> None:
        seen.append(step)
        submit(step)

    stack.group.submit = recording
    return seen


def req_id_of(step: SchedulerOutput) -> str | None:
    """The one request a single-request test's step carries (None for an empty one)."""
    return next(iter(step.num_scheduled_tokens), None)


def steps_of(steps: list[SchedulerOutput], req_id: str) -> int:
    return sum(req_id in s.num_scheduled_tokens for s in steps)


def status(stack) -> engine_pb2.EngineStatus:
    return stack.engine_stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10)


def run_all(stack, prompts, **sampling) -> tuple[SessionClient, list[str]]:
    client = SessionClient(stack.engine_stub)
    ids = [rid() for _ in prompts]
    for req_id, prompt in zip(ids, prompts):
        client.add(req_id, prompt, temperature=0.0, **sampling)
    client.wait_ended(*ids)
    return client, ids


def pool_is_fully_free(stack) -> bool:
    st = status(stack)
    return st.num_free_blocks == st.num_kv_blocks - 1


# ---------------------------------------------------------------------------
# the engine with two steps in flight


def test_async_greedy_outputs_equal_sync_outputs_and_transformers(tiny_runner, hf_model):
    outputs = {}
    for async_scheduling in (True, False):
        stack = start_wire_stack(tiny_runner, async_scheduling=async_scheduling)
        try:
            steps = record_steps(stack)
            client, ids = run_all(stack, PROMPTS, max_tokens=12, ignore_eos=True)
            outputs[async_scheduling] = [client.tokens[r] for r in ids]
            assert all(client.finished[r].finish_reason == LENGTH for r in ids)
            wait_for(lambda: pool_is_fully_free(stack), what="all blocks free")
            client.close()
        finally:
            stack.close()
        if async_scheduling:  # the worker filled in tokens the scheduler had not seen
            assert stack.scheduler_core.config.async_scheduling and len(steps) >= 12
    assert outputs[True] == outputs[False]
    for prompt, tokens in zip(PROMPTS, outputs[True]):
        assert tokens == hf_greedy(hf_model, prompt, 12), prompt


def test_the_step_after_a_stop_token_skips_the_request_and_sends_nothing(
        async_stack, tiny_runner, hf_model):
    prompt = PROMPTS[0]
    ref = hf_greedy(hf_model, prompt, 12)
    stop = ref[3]
    k = ref.index(stop)  # the first time greedy produces it
    steps = record_steps(async_stack)
    answers = []
    execute = tiny_runner.execute

    def answering(step, *a, **kw):
        """The worker's answer, held back on the step that samples the stop until the
        engine has submitted the request's next step (async: it schedules ahead without
        waiting for this answer), so that next step exists whatever the machine's load."""
        answer = execute(step, *a, **kw)
        answers.append(answer)
        rid = req_id_of(step)
        if rid and any(stop in t for t in answer.sampled_token_ids):
            wait_for(lambda: any(s.step_id > step.step_id and rid in s.num_scheduled_tokens
                                 for s in list(steps)),
                     what="the step scheduled before the stop is known")
        return answer

    tiny_runner.execute = answering
    try:
        client, (req_id,) = run_all(async_stack, [prompt], max_tokens=12,
                                    stop_token_ids=[stop])
    finally:
        del tiny_runner.execute
    out = client.finished[req_id]
    assert client.tokens[req_id] == ref[:k + 1]
    assert out.finish_reason == STOP and out.stop_token_id == stop
    # it was scheduled once more before its stop was known; the worker, which saw
    # the stop, skipped it there: no token, no forward pass
    assert steps_of(steps, req_id) == k + 2
    last = next(a for a in reversed(answers) if req_id in a.req_ids)
    assert last.sampled_token_ids == [[]] and last.timings.num_forward_passes == 0
    wait_for(lambda: pool_is_fully_free(async_stack), what="all blocks free")
    client.close()


def test_request_certain_to_reach_max_tokens_is_not_scheduled_again(async_stack, hf_model):
    steps = record_steps(async_stack)
    client, (req_id,) = run_all(async_stack, [PROMPTS[1]], max_tokens=5, ignore_eos=True)
    assert client.tokens[req_id] == hf_greedy(hf_model, PROMPTS[1], 5)
    assert client.finished[req_id].finish_reason == LENGTH
    assert steps_of(steps, req_id) == 5  # one step per output token, none extra
    client.close()


def test_abort_while_steps_are_in_flight_ends_the_stream_and_frees_everything(
        async_stack, tiny_runner, hf_model):
    prompt = PROMPTS[2]
    client = SessionClient(async_stack.engine_stub)
    req_id = rid()
    client.add(req_id, prompt, temperature=0.0, max_tokens=200, ignore_eos=True)
    while len(client.tokens.get(req_id, [])) < 3:
        client.read()
    client.abort(req_id)
    client.wait_ended(req_id)
    tokens = client.tokens[req_id]
    assert client.finished[req_id].finish_reason == ABORT
    assert 3 <= len(tokens) < 200
    assert tokens == hf_greedy(hf_model, prompt, len(tokens))
    wait_for(lambda: pool_is_fully_free(async_stack), what="all blocks free")
    # the engine goes on: the next request is exact, and its first step tells the
    # worker to drop the aborted one
    client2, (other,) = run_all(async_stack, [PROMPTS[3]], max_tokens=6, ignore_eos=True)
    assert client2.tokens[other] == hf_greedy(hf_model, PROMPTS[3], 6)
    assert req_id not in tiny_runner.requests
    client.close()
    client2.close()


def test_preemption_while_steps_are_in_flight_keeps_greedy_outputs_exact(
        small_pool_runner, hf_model):
    shared = list(range(300, 316))  # one full block in common: prefix-cache hits
    prompts = [shared + [11 * i + 5, 3, 9 + i] for i in range(5)]
    outputs = {}
    for async_scheduling in (True, False):
        stack = start_wire_stack(small_pool_runner, async_scheduling=async_scheduling)
        try:
            client, ids = run_all(stack, prompts, max_tokens=40, ignore_eos=True)
            outputs[async_scheduling] = [client.tokens[r] for r in ids]
            st = status(stack)
            assert st.num_preemptions_total > 0
            assert st.prefix_cache_hits > 0
            wait_for(lambda: pool_is_fully_free(stack), what="all blocks free")
            client.close()
        finally:
            stack.close()
    assert outputs[True] == outputs[False]
    for prompt, tokens in zip(prompts, outputs[True]):
        assert tokens == hf_greedy(hf_model, prompt, 40), prompt


# ---------------------------------------------------------------------------
# the worker's step pipe


def new_request_step(step_id: int, req_id: str, prompt: list[int], block: int) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=[NewRequestData(req_id, prompt, SamplingParams(temperature=0.0),
                                           [block], 0)],
        num_scheduled_tokens={req_id: len(prompt)}, total_num_scheduled_tokens=len(prompt))


def test_a_failed_step_is_answered_with_its_error_and_later_steps_are_skipped_until_a_reset(
        tiny_runner):
    bad = SchedulerOutput(step_id=1, num_scheduled_tokens={"nobody": 1},
                          total_num_scheduled_tokens=1)
    reset = new_request_step(3, "after-reset", [6, 7], 3)
    reset.reset_requests = True
    steps = [new_request_step(0, "first", [1, 2, 3], 1), bad,
             new_request_step(2, "after-bad", [4, 5], 2), reset]
    pipe = StepPipe(tiny_runner)
    pipe.start(iter([scheduler_output_to_proto(s) for s in steps]))
    results = [pipe.results.get() for _ in range(4)]
    assert pipe.results.get() is _END
    pipe.stop()
    try:
        first, failed, skipped, after = (r[1] for r in results)
        assert [r.step_id for r in (first, failed, skipped, after)] == [0, 1, 2, 3]
        assert len(first.sampled_token_ids[0]) == 1 and not first.error
        assert failed.error.startswith("StepError: ") and not failed.step_skipped  # as data
        assert skipped.step_skipped and "step 1 failed" in skipped.error
        assert not after.error and len(after.sampled_token_ids[0]) == 1
        # the failure dropped "first"; the skipped step ran nothing; the reset step ran
        assert set(tiny_runner.requests) == {"after-reset"}
    finally:
        tiny_runner.drop_requests()


def test_every_step_runs_on_the_one_compute_thread(tiny_runner, monkeypatch):
    """Steps of successive streams all run on worker_svc.compute's thread: a second
    thread starting OpenMP teams would throttle the first's (see compute.py)."""
    threads = []
    real_execute = tiny_runner.execute

    def execute(step, **kwargs):
        threads.append(threading.get_ident())
        return real_execute(step, **kwargs)

    monkeypatch.setattr(tiny_runner, "execute", execute)
    for n, req_id in enumerate(("one", "two")):  # one stream each: one pipe per stream
        pipe = StepPipe(tiny_runner)
        pipe.start(iter([scheduler_output_to_proto(new_request_step(n, req_id, [1, 2], n + 1))]))
        assert pipe.results.get()[0].step_id == n
        assert pipe.results.get() is _END
        pipe.stop()
    compute.run(real_execute, SchedulerOutput(step_id=-1, finished_req_ids={"one", "two"}))
    assert len(threads) == 2 and threads[0] == threads[1] != threading.get_ident()
    assert compute.run(threading.get_ident) == threads[0]


def test_a_result_goes_out_once_the_next_steps_inputs_are_built(tiny_runner, monkeypatch):
    """The sender's Python must not run against the next step's input preparation
    (both need the GIL): a result is handed over after the next step is prepared and
    before its forward pass; the last one, with no step after it, at once."""
    second_read = threading.Event()
    seen = {}
    real_execute = tiny_runner.execute
    pipe = StepPipe(tiny_runner)

    def steps():
        yield scheduler_output_to_proto(new_request_step(0, "a", [1, 2, 3], 1))
        yield scheduler_output_to_proto(new_request_step(1, "b", [4, 5], 2))
        second_read.set()  # the reader asks for a third: step 1 is queued

    def execute(step, on_prepared=None):
        if step.step_id == 0:
            second_read.wait()  # step 1 is waiting when step 0 ends
            return real_execute(step, on_prepared=on_prepared)

        def prepared():
            seen["before"] = pipe.results.empty()
            on_prepared()
            seen["after"] = not pipe.results.empty()
        return real_execute(step, on_prepared=prepared)

    monkeypatch.setattr(tiny_runner, "execute", execute)
    pipe.start(steps())
    assert [pipe.results.get()[1].step_id for _ in range(2)] == [0, 1]
    assert pipe.results.get() is _END
    pipe.stop()
    tiny_runner.execute(SchedulerOutput(step_id=-1, finished_req_ids={"a", "b"}))
    assert seen == {"before": True, "after": True}


def test_a_result_with_no_step_waiting_behind_it_is_not_held(tiny_runner):
    """Without async scheduling the next step comes only after this result: holding
    it for a next step's inputs would hang the stream."""
    got_first = threading.Event()
    pipe = StepPipe(tiny_runner)

    def steps():
        yield scheduler_output_to_proto(new_request_step(0, "c", [1, 2, 3], 1))
        got_first.wait()

    pipe.start(steps())
    first = pipe.results.get(timeout=60)  # bounds a regression; a pass returns at once
    got_first.set()
    assert first[0].step_id == 0 and pipe.results.get() is _END
    pipe.stop()
    tiny_runner.execute(SchedulerOutput(step_id=-1, finished_req_ids={"c"}))


def test_idle_time_is_the_gap_between_one_step_ending_and_the_next_starting(tiny_runner):
    wire: queue.SimpleQueue = queue.SimpleQueue()
    pipe = StepPipe(tiny_runner)
    pipe.start(iter(wire.get, None))
    try:
        wire.put(scheduler_output_to_proto(new_request_step(0, "a", [1, 2, 3], 1)))
        _, first = pipe.results.get()
        time.sleep(0.05)  # not synchronization: a known stretch with no step to run
        wire.put(scheduler_output_to_proto(new_request_step(1, "b", [4, 5], 2)))
        _, second = pipe.results.get()
        assert first.timings.idle_ms == 0.0  # the first step of a stream has no predecessor
        assert second.timings.idle_ms >= 50.0
        assert second.timings.idle_ms <= (second.timings.start_unix_s
                                          - first.timings.end_unix_s) * 1e3 + 1.0
    finally:
        wire.put(None)
        pipe.stop()
        tiny_runner.execute(SchedulerOutput(step_id=-1, finished_req_ids={"a", "b"}))


def test_async_scheduling_is_on_by_default_and_can_be_turned_off():
    from scheduler_svc.server import scheduler_config
    from shared import config as flags
    from shared.types import ModelInfo

    info = ModelInfo("m", 100, 256, [2], 2, 2, 16, "float32", 64, 16)
    on = flags.parse_args(flags.scheduler_parser(), [], environ={})
    off = flags.parse_args(flags.scheduler_parser(), ["--no-async-scheduling"], environ={})
    assert scheduler_config(on, info).async_scheduling is True
    assert scheduler_config(off, info).async_scheduling is False


def test_the_worker_feeds_each_sampled_token_from_the_device_not_its_host_copy(tiny_runner):
    from shared.types import CachedRequestData
    prompt, WRONG = [1, 504, 3209, 28, 253], 4242

    def two_steps(req_id: str, corrupt_host_copy: bool) -> tuple[int, int]:
        first = tiny_runner.execute(new_request_step(0, req_id, prompt, 1)).sampled_token_ids[0][0]
        if corrupt_host_copy:  # what the host believes; the device copy is untouched
            tiny_runner.requests[req_id].token_ids[-1] = WRONG
        cached = CachedRequestData()
        cached.append(req_id, False, [], len(prompt))
        step = SchedulerOutput(step_id=1, scheduled_cached_reqs=cached,
                               num_scheduled_tokens={req_id: 1}, total_num_scheduled_tokens=1)
        second = tiny_runner.execute(step).sampled_token_ids[0][0]
        tiny_runner.execute(SchedulerOutput(step_id=-1, finished_req_ids={req_id}))
        return first, second

    clean = two_steps("clean", False)
    assert clean[0] != WRONG
    assert two_steps("host-copy-corrupted", True) == clean
    # and the token fed really decides the next one: WRONG in its place gives another
    fed_wrong = tiny_runner.execute(new_request_step(0, "fed-wrong", prompt + [WRONG], 1))
    tiny_runner.execute(SchedulerOutput(step_id=-1, finished_req_ids={"fed-wrong"}))
    assert fed_wrong.sampled_token_ids[0][0] != clean[1]
