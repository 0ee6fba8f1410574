"""/tokenize, /detokenize and gRPC Tokenize run on their own thread: a flood of them
queues behind itself, never in front of a generation request's prompt."""

import asyncio
import threading

from frontend_svc.request.context import Frontend
from frontend_svc.engine.engine_client import EngineClient
from frontend_svc.telemetry.observe import Observer


def test_a_busy_tokenize_endpoint_thread_leaves_generation_tokenizing(tokenizer):
    async def scenario() -> None:
        fe = Frontend(EngineClient("127.0.0.1:1"), tokenizer, "m", "m", Observer("m"))
        release = threading.Event()
        try:
            blocked = asyncio.ensure_future(fe.offload_utility(release.wait))
            # generation's tokenizing finishes while the endpoint thread is held
            ids = await asyncio.wait_for(fe.offload(tokenizer.encode, "Hello there"), 10)
            assert ids and not blocked.done()
            # and a second endpoint call queues behind the first, on that thread only
            queued = asyncio.ensure_future(fe.offload_utility(tokenizer.encode, "x"))
            await asyncio.sleep(0)
            assert not queued.done()
        finally:
            release.set()
        assert await blocked is True
        assert await queued
        fe.pool.shutdown()
        fe.utility_pool.shutdown()

    asyncio.run(scenario())
