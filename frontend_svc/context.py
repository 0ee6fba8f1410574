"""What both client APIs (HTTP and gRPC) share: the engine client, the tokenizer,
the served name, and running a request's choices against the scheduler."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from frontend_svc.engine_client import EngineClient
from frontend_svc.errors import EngineError
from frontend_svc import generation
from frontend_svc.generation import Choice
from frontend_svc.observe import Observer
from frontend_svc.request_state import Delta, RequestState
from frontend_svc.tokenizer import TextTokenizer
from frontend_svc.translate import ModelLimits


@dataclass(slots=True)
class Frontend:
    engine: EngineClient
    tokenizer: TextTokenizer
    served_model_name: str
    model_path: str
    observer: Observer

    @property
    def ready(self) -> bool:
        return self.engine.ready

    @property
    def limits(self) -> ModelLimits:
        info = self.engine.model_info
        if info is None:
            raise EngineError(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected yet")
        return ModelLimits(info.max_model_len, info.vocab_size)

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def run(self, choices: list[Choice]) -> list[RequestState]:
        """Run all choices concurrently to the end; the first error (or the caller's
        cancellation) aborts the rest."""
        async def collect(choice: Choice) -> RequestState:
            async with aclosing(generation.stream(self.engine, self.tokenizer, choice,
                                       self.observer)) as deltas:
                async for state, _ in deltas:
                    pass
            return state

        tasks = [asyncio.ensure_future(collect(c)) for c in choices]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def stream(self, choices: list[Choice]
                     ) -> AsyncIterator[tuple[int, RequestState, Delta]]:
        """Deltas of all choices as they come, tagged with the choice's index."""
        if len(choices) == 1:
            async with aclosing(generation.stream(self.engine, self.tokenizer, choices[0],
                                       self.observer)) as deltas:
                async for state, delta in deltas:
                    yield 0, state, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, choice: Choice) -> None:
            try:
                async with aclosing(generation.stream(self.engine, self.tokenizer, choice,
                                           self.observer)) as deltas:
                    async for state, delta in deltas:
                        queue.put_nowait((index, state, delta))
                queue.put_nowait((index, None, None))
            except EngineError as exc:
                queue.put_nowait((index, None, exc))

        tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
        try:
            remaining = len(tasks)
            while remaining:
                index, state, delta = await queue.get()
                if isinstance(delta, EngineError):
                    raise delta
                if state is None:
                    remaining -= 1
                    continue
                yield index, state, delta
        finally:
            for task in tasks:
                task.cancel()
