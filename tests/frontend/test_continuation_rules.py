"""Scheduler loss, seen from the frontend without a network: open requests are
kept with their tokens so far and re-submitted as continuations on the next
session (prompt + generated, remaining max_tokens, a fresh wire id); the client's
queue continues under its own id; requests give up only after RESUME_TIMEOUT_S."""

import asyncio

import grpc

from frontend_svc.request.choice import Choice
from frontend_svc.engine import engine_client
from frontend_svc.engine.engine_client import EngineClient
from frontend_svc.errors import EngineError
from shared.proto import common_pb2, engine_pb2
from shared.types import FinishReason, SamplingParams


def run(coro):
    return asyncio.run(coro)


def output(wire_id, tokens, finish=None, cached=0):
    msg = engine_pb2.RequestOutput(request_id=wire_id, new_token_ids=tokens,
                                   num_cached_tokens=cached)
    if finish is not None:
        msg.finish_reason = finish
    return engine_pb2.EngineResponse(outputs=[msg])


def connected_client() -> EngineClient:
    client = EngineClient("127.0.0.1:1")  # never dialled: the session is simulated
    client._outbox = asyncio.Queue()
    return client


async def lose_and_reconnect(client) -> asyncio.Queue:
    client._outbox = None
    client._suspend_all()
    outbox: asyncio.Queue = asyncio.Queue()
    client._outbox = outbox
    client._resume_all(outbox)
    return outbox


def test_an_open_request_is_resubmitted_as_its_continuation():
    async def body():
        client = connected_client()
        queue = client.add(Choice.for_prompt(
            "a", [1, 2], SamplingParams(max_tokens=10, min_tokens=3)))
        client._route(output("a", [7, 8], cached=2))
        outbox = await lose_and_reconnect(client)
        add = outbox.get_nowait().add
        assert list(add.prompt_token_ids) == [1, 2, 7, 8]
        assert add.sampling_params.max_tokens == 8 and add.sampling_params.min_tokens == 1
        assert add.request_id != "a" and client.num_resumed == 1
        client._route(output("a", [99]))  # the old scheduler's id is no longer routed
        client._route(output(add.request_id, [9], common_pb2.FINISH_REASON_LENGTH, cached=4))
        outs = [queue.get_nowait() for _ in range(2)]
        assert [o.new_token_ids for o in outs] == [[7, 8], [9]]
        assert all(o.req_id == "a" for o in outs)
        assert outs[1].finish_reason == FinishReason.LENGTH
        assert outs[1].num_cached_tokens == 2  # of the client's prompt, not the continuation
        assert client.num_active == 0 and not client._open and not client._wire
        await client.close()
    run(body())


def test_a_continuation_says_how_much_of_its_prompt_is_output_across_every_resume():
    # penalties count those tokens as output and seeded draws go on from that position
    async def body():
        client = connected_client()
        client.add(Choice.for_prompt(
            "a", [1, 2, 3], SamplingParams(max_tokens=10, seed=7, frequency_penalty=1.0)))
        first = client._outbox.get_nowait().add
        assert first.sampling_params.num_output_prefix_tokens == 0
        client._route(output("a", [7, 8]))
        add = (await lose_and_reconnect(client)).get_nowait().add
        assert list(add.prompt_token_ids) == [1, 2, 3, 7, 8]
        assert add.sampling_params.num_output_prefix_tokens == 2
        assert add.sampling_params.seed == 7  # the same seed: the position carries on
        client._route(output(add.request_id, [9]))
        again = (await lose_and_reconnect(client)).get_nowait().add
        assert list(again.prompt_token_ids) == [1, 2, 3, 7, 8, 9]
        assert again.sampling_params.num_output_prefix_tokens == 3
        assert again.sampling_params.max_tokens == 7
        await client.close()
    run(body())


def test_an_abort_after_resubmission_names_the_new_wire_id():
    async def body():
        client = connected_client()
        client.add(Choice.for_prompt("a", [1], SamplingParams(max_tokens=5)))
        outbox = await lose_and_reconnect(client)
        wire_id = outbox.get_nowait().add.request_id
        assert client.abort(["a"]) == 1
        assert list(outbox.get_nowait().abort.request_ids) == [wire_id]
        await client.close()
    run(body())


def test_requests_give_up_with_a_clean_error_if_no_scheduler_comes_back(monkeypatch):
    monkeypatch.setattr(engine_client, "RESUME_TIMEOUT_S", 0.01)

    async def body():
        client = connected_client()
        queue = client.add(Choice.for_prompt("a", [1], SamplingParams()))
        client._outbox = None
        client._suspend_all()
        error = await asyncio.wait_for(queue.get(), 5)
        assert isinstance(error, EngineError) and error.code == grpc.StatusCode.UNAVAILABLE
        assert "did not come back within" in error.message and "<" not in error.message
        assert client.num_active == 0
        await client.close()
    run(body())


def test_a_request_added_while_the_scheduler_is_away_waits_for_the_next_session():
    async def body():
        client = connected_client()
        client.model_info = object()  # it was connected once
        client._outbox = None
        client._suspend_all()  # the scheduler is away
        queue = client.add(Choice.for_prompt("late", [4, 5], SamplingParams(max_tokens=3)))
        assert client.num_active == 1 and queue.empty()  # held, not failed
        outbox = await lose_and_reconnect(client)
        add = outbox.get_nowait().add
        assert list(add.prompt_token_ids) == [4, 5] and add.sampling_params.max_tokens == 3
        client._route(output(add.request_id, [6], common_pb2.FINISH_REASON_LENGTH))
        assert queue.get_nowait().req_id == "late"
        await client.close()
    run(body())
