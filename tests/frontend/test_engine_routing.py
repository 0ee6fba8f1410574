"""The engine client's routing, without a network: outputs reach only their own
request's queue, scheduler statuses become the right HTTP codes, aborts end a
waiting reader and are sent to the scheduler."""

import asyncio

import grpc
import pytest

from frontend_svc.request.choice import Choice
from frontend_svc.engine.engine_client import EngineClient
from frontend_svc.errors import EngineError
from shared.proto import common_pb2, engine_pb2
from shared.types import FinishReason, SamplingParams


def run(coro):
    return asyncio.run(coro)


async def connected_client() -> EngineClient:
    client = EngineClient("127.0.0.1:1")  # never dialled: the session is simulated
    client._outbox = asyncio.Queue()
    return client


def test_outputs_reach_only_the_owning_request_and_finished_ones_are_forgotten():
    async def body():
        client = await connected_client()
        a = client.add(Choice.for_prompt("a", [1, 2], SamplingParams()))
        b = client.add(Choice.for_prompt("b", [3], SamplingParams()))
        sent = client._outbox.get_nowait()
        assert sent.add.request_id == "a" and list(sent.add.prompt_token_ids) == [1, 2]
        client._route(engine_pb2.EngineResponse(outputs=[
            engine_pb2.RequestOutput(request_id="a", new_token_ids=[7]),
            engine_pb2.RequestOutput(request_id="b", new_token_ids=[8],
                                     finish_reason=common_pb2.FINISH_REASON_LENGTH),
            engine_pb2.RequestOutput(request_id="gone", new_token_ids=[9])]))
        assert a.get_nowait().new_token_ids == [7] and a.empty()
        out_b = b.get_nowait()
        assert out_b.new_token_ids == [8] and out_b.finish_reason == FinishReason.LENGTH
        assert client.num_active == 1  # b finished at the scheduler
        await client.close()
    run(body())


@pytest.mark.parametrize("code, http", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.ALREADY_EXISTS, 409),
    (grpc.StatusCode.INTERNAL, 500)])
def test_a_rejection_becomes_an_error_with_its_http_status(code, http):
    async def body():
        client = await connected_client()
        queue = client.add(Choice.for_prompt("a", [1], SamplingParams()))
        client._route(engine_pb2.EngineResponse(rejections=[engine_pb2.Rejection(
            request_id="a", status=common_pb2.Status(code=code.value[0], message="no"))]))
        error = queue.get_nowait()
        assert isinstance(error, EngineError) and error.code == code
        assert error.http_status == http and client.num_active == 0
        await client.close()
    run(body())


def test_abort_ends_a_waiting_reader_and_tells_the_scheduler():
    async def body():
        client = await connected_client()
        queue = client.add(Choice.for_prompt("a", [1], SamplingParams()))
        client._outbox.get_nowait()
        assert client.abort(["a", "unknown"]) == 1
        assert queue.get_nowait().finish_reason == FinishReason.ABORT
        sent = client._outbox.get_nowait()
        assert list(sent.abort.request_ids) == ["a", "unknown"]
        await client.close()
    run(body())


def test_adding_without_a_session_is_unavailable_and_queues_nothing():
    async def body():
        client = EngineClient("127.0.0.1:1")
        with pytest.raises(EngineError) as err:
            client.add(Choice.for_prompt("a", [1], SamplingParams()))
        assert err.value.http_status == 503 and client.num_active == 0
        await client.close()
    run(body())
