"""The scheduler's Engine API and the worker's Step stream, over loopback gRPC,
driving the real Scheduler and ModelRunner on a tiny random-weight model."""

from __future__ import annotations

import uuid

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.proto import common_pb2, engine_pb2, worker_pb2, worker_pb2_grpc
from tests.wire.session_client import SessionClient, abort_message, add_message, wait_for
from tests.integration.hf_reference import hf_greedy

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS.value[0]
PROMPTS = [[1, 504, 3209, 28, 253], [7, 7, 7], list(range(100, 140)), [4821, 99, 3, 17, 5, 8, 1000]]


def rid() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()



def free_blocks(stack) -> tuple[int, int]:
    status = stack.engine_stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10)
    return status.num_free_blocks, status.num_kv_blocks - 1


def test_concurrent_greedy_outputs_equal_transformers_alone(wire_stack, hf_model):
    client = SessionClient(wire_stack.engine_stub)
    ids = [rid() for _ in PROMPTS]
    for req_id, prompt in zip(ids, PROMPTS):
        client.add(req_id, prompt, temperature=0.0, max_tokens=12, ignore_eos=True)
    client.wait_ended(*ids)
    for req_id, prompt in zip(ids, PROMPTS):
        assert client.tokens[req_id] == hf_greedy(hf_model, prompt, 12), prompt
        assert client.finished[req_id].finish_reason == common_pb2.FINISH_REASON_LENGTH
    client.close()


@pytest.mark.parametrize("prompt,sampling,needle", [
    ([], {}, "at least one token"),
    ([1, 49152], {}, "outside the vocabulary"),
    ([1] * 256, {}, "max_model_len"),
    ([1] * 200, {"max_tokens": 100}, "exceeds max_model_len"),
    ([1, 2], {"temperature": -1.0}, "temperature"),
    ([1, 2], {"top_p": 0.0}, "top_p"),
    ([1, 2], {"num_output_prefix_tokens": 2}, "must be less than the prompt's 2 tokens"),
    ([1, 2], {"num_output_prefix_tokens": -1}, "num_output_prefix_tokens must be non-negative"),
])
def test_bad_request_is_rejected_invalid_argument_and_nothing_is_queued(
        wire_stack, prompt, sampling, needle):
    client = SessionClient(wire_stack.engine_stub)
    bad = rid()
    client.add(bad, prompt, **sampling)
    client.wait_ended(bad)
    assert client.rejected[bad].status.code == INVALID_ARGUMENT
    assert needle in client.rejected[bad].status.message
    assert not wire_stack.engine.run_on_loop(wire_stack.scheduler_core.has_unfinished_requests)
    good = rid()  # and the stack keeps serving
    client.add(good, [5, 6, 7], temperature=0.0, max_tokens=2)
    client.wait_ended(good)
    assert len(client.tokens[good]) >= 1
    client.close()


def test_a_running_request_id_cannot_be_added_twice(wire_stack):
    client = SessionClient(wire_stack.engine_stub)
    req_id = rid()
    client.add(req_id, [1, 2, 3], temperature=0.0, max_tokens=200, ignore_eos=True)
    client.add(req_id, [1, 2, 3], temperature=0.0, max_tokens=4)
    while req_id not in client.rejected:
        client.read()
    assert client.rejected[req_id].status.code == ALREADY_EXISTS
    client.abort(req_id)
    client.wait_ended(req_id)
    client.close()


def test_abort_ends_the_request_with_abort_and_frees_its_blocks(wire_stack):
    client = SessionClient(wire_stack.engine_stub)
    req_id = rid()
    client.add(req_id, list(range(10, 60)), temperature=0.0, max_tokens=200, ignore_eos=True)
    while not client.tokens.get(req_id):
        client.read()
    client.abort(req_id)
    client.wait_ended(req_id)
    assert client.finished[req_id].finish_reason == common_pb2.FINISH_REASON_ABORT
    free, total = free_blocks(wire_stack)
    assert free == total
    client.close()


def test_a_batch_is_handled_as_its_requests_one_by_one_in_order(wire_stack, hf_model):
    client = SessionClient(wire_stack.engine_stub)
    nested, good, bad, dropped = rid(), rid(), rid(), rid()
    client.send_batch(
        # a batch inside a batch is skipped: had it been added, it would still run below
        engine_pb2.EngineRequest(batch=engine_pb2.EngineRequests(requests=[add_message(
            nested, [1, 2, 3], temperature=0.0, max_tokens=200, ignore_eos=True)])),
        add_message(good, PROMPTS[0], temperature=0.0, max_tokens=12, ignore_eos=True),
        add_message(bad, []),  # refused alone; the rest of the batch goes on
        add_message(dropped, [5, 6], temperature=0.0, max_tokens=200, ignore_eos=True),
        abort_message(dropped))  # after its add, as the frontend queued them
    client.wait_ended(good, bad, dropped)
    assert client.tokens[good] == hf_greedy(hf_model, PROMPTS[0], 12)
    assert client.rejected[bad].status.code == INVALID_ARGUMENT
    assert client.finished[dropped].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert nested not in client.tokens and nested not in client.rejected
    assert not wire_stack.engine.run_on_loop(wire_stack.scheduler_core.has_unfinished_requests)
    wait_for(lambda: free_blocks(wire_stack)[0] == free_blocks(wire_stack)[1],
             what="all KV blocks free")
    client.close()


def test_closing_a_session_aborts_its_requests_and_frees_their_blocks(wire_stack):
    client = SessionClient(wire_stack.engine_stub)
    ids = [rid() for _ in range(3)]
    for req_id in ids:
        client.add(req_id, list(range(30, 70)), temperature=0.0, max_tokens=200, ignore_eos=True)
    while len(client.tokens) < 3:
        client.read()
    client.close()
    wait_for(lambda: free_blocks(wire_stack)[0] == free_blocks(wire_stack)[1],
             what="all KV blocks free")
    assert not wire_stack.engine.run_on_loop(wire_stack.scheduler_core.has_unfinished_requests)


def test_outputs_go_only_to_the_session_that_owns_the_request(wire_stack):
    a, b = SessionClient(wire_stack.engine_stub), SessionClient(wire_stack.engine_stub)
    ra, rb = rid(), rid()
    a.add(ra, [1, 2, 3], temperature=0.0, max_tokens=5, ignore_eos=True)
    b.add(rb, [4, 5, 6], temperature=0.0, max_tokens=5, ignore_eos=True)
    a.wait_ended(ra)
    b.wait_ended(rb)
    assert set(a.tokens) == {ra} and set(b.tokens) == {rb}
    a.close()
    b.close()


def test_seeded_sampling_is_reproducible(wire_stack):
    client = SessionClient(wire_stack.engine_stub)
    ids = [rid(), rid()]
    for req_id in ids:
        client.add(req_id, [1, 2, 3, 4], temperature=1.0, seed=1234, max_tokens=10,
                   ignore_eos=True)
    client.wait_ended(*ids)
    assert client.tokens[ids[0]] == client.tokens[ids[1]]
    client.close()


def test_model_info_and_status_describe_the_pool(wire_stack, tiny_runner):
    info = wire_stack.engine_stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5)
    assert info.num_kv_blocks == tiny_runner.num_kv_blocks and info.block_size == 16
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2]
    status = wire_stack.engine_stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
    assert status.diagnosis == "healthy" and status.max_num_seqs == 16


def test_every_service_answers_health_serving_and_reflection(wire_stack):
    for server, name in ((wire_stack.scheduler, "gapserve.v1.Engine"),
                         (wire_stack.worker, "gapserve.v1.Worker")):
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", name):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            names = {s.name for s in next(replies).list_services_response.service}
            assert name in names and "grpc.health.v1.Health" in names


def test_a_second_scheduler_cannot_drive_a_busy_worker(wire_stack):
    with grpc.insecure_channel(f"127.0.0.1:{wire_stack.worker.port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        replies = stub.Step(iter([worker_pb2.SchedulerOutput(step_id=10**9)]), timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            next(replies)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_new_scheduler_finds_the_worker_clean_after_the_old_stream_ends(tiny_runner):
    from tests.wire.conftest import start_wire_stack
    first = start_wire_stack(tiny_runner)
    client = SessionClient(first.engine_stub)
    client.add("same-id", [1, 2, 3], temperature=0.0, max_tokens=200, ignore_eos=True)
    while not client.tokens.get("same-id"):
        client.read()
    first.close()  # the scheduler goes away mid-request
    wait_for(lambda: not tiny_runner.requests, what="the worker to drop the old requests")
    second = start_wire_stack(tiny_runner)
    try:
        client = SessionClient(second.engine_stub)
        client.add("same-id", [1, 2, 3], temperature=0.0, max_tokens=3, ignore_eos=True)
        client.wait_ended("same-id")
        assert len(client.tokens["same-id"]) == 3
        client.close()
    finally:
        second.close()


def test_an_idle_engine_runs_no_steps(wire_stack):
    client = SessionClient(wire_stack.engine_stub)
    client.add(rid(), [1, 2, 3], temperature=0.0, max_tokens=2, ignore_eos=True)
    while not client.finished:
        client.read()
    # GetStatus runs on the loop thread, so each answer comes after any pending work
    before = wire_stack.engine_stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
    after = wire_stack.engine_stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
    assert before.num_steps_total == after.num_steps_total > 0
    client.close()
