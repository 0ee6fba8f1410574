"""What both client APIs (HTTP and gRPC) share: the engine client, the tokenizer,
the served name, and running a request's choices against the scheduler."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from shared.config import DEFAULT_COMPILE_TIMEOUT_S
from shared.structured.compile_cache import grammar_vocab

from frontend_svc.request.admission import Admission
from frontend_svc.api.auth import ApiKeys
from frontend_svc.request.caps import RequestCaps
from frontend_svc.engine.engine_client import EngineClient
from frontend_svc.errors import EngineError
from frontend_svc.request import generation
from frontend_svc.request.choice import Choice
from frontend_svc.telemetry.observe import Observer, log
from frontend_svc.request.output_stream import Delta, OutputStream
from frontend_svc.request.tokenizer import TextTokenizer
from frontend_svc.structured.tools import ToolConfig
from frontend_svc.request.translate import ModelLimits

T = TypeVar("T")


@dataclass(slots=True)
class Frontend:
    engine: EngineClient
    tokenizer: TextTokenizer
    served_model_name: str
    model_path: str
    observer: Observer
    keys: ApiKeys = field(default_factory=ApiKeys)
    caps: RequestCaps = field(default_factory=RequestCaps)
    admission: Admission = field(default_factory=lambda: Admission(1024))
    # tokenizing and chat templating: off the event loop that serves every stream
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tokenize"))
    # /tokenize, /detokenize and gRPC Tokenize: their own thread, so a flood of them
    # queues behind itself and never in front of a generation request's prompt
    utility_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize-api"))
    tools: ToolConfig = field(default_factory=ToolConfig)  # --enable-auto-tool-choice, ...
    # compiling structured outputs' grammars (translate.check_constraints): a slow one
    # (up to the compile timeout) waits here, not on a thread that tokenizes prompts
    grammar_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="grammar"))
    # --structured-outputs-compile-timeout-s, the same bound rank 0 compiles under
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S

    @property
    def ready(self) -> bool:
        return self.engine.ready

    @property
    def limits(self) -> ModelLimits:
        info = self.engine.model_info
        if info is None:
            raise EngineError(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected yet")
        return ModelLimits(info.max_model_len, info.vocab_size,
                           self.caps.for_model(info.max_model_len, self.tokenizer.max_token_bytes),
                           # the vocabulary rank 0 compiles against: the workers' size, EOS
                           functools.partial(grammar_vocab, self.model_path, info.vocab_size,
                                             list(info.eos_token_ids) or None),
                           self.compile_timeout_s)

    def warm_grammar_vocab(self) -> None:
        """Build the model's grammar vocabulary (about a second, once per process) on
        the pool when the scheduler connects, not on the first structured request."""
        try:
            self.limits.grammar_vocab()
        except Exception as exc:  # structured requests will say it; serving goes on
            log.warning("no grammar vocabulary for structured outputs", error=str(exc))

    async def offload(self, fn: Callable[..., T], *args) -> T:
        """Run a tokenizing call on the pool; the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(fn, *args))

    async def offload_grammar(self, fn: Callable[..., T], *args) -> T:
        """Run a grammar compile (structured-output validation) on its own pool."""
        return await asyncio.get_running_loop().run_in_executor(
            self.grammar_pool, functools.partial(fn, *args))

    async def offload_utility(self, fn: Callable[..., T], *args) -> T:
        """Run a tokenize/detokenize endpoint's work on its own thread (utility_pool)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.utility_pool, functools.partial(fn, *args))

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def run(self, choices: list[Choice]) -> list[OutputStream]:
        """Run all choices concurrently to the end; the first error (or the caller's
        cancellation) aborts the rest."""
        async def collect(choice: Choice) -> OutputStream:
            async with aclosing(generation.stream(self.engine, self.tokenizer, choice,
                                       self.observer)) as deltas:
                async for state, _ in deltas:
                    pass
            return state

        with self.admission.admit(len(choices)):
            tasks = [asyncio.ensure_future(collect(c)) for c in choices]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()

    async def stream(self, choices: list[Choice]
                     ) -> AsyncIterator[tuple[int, OutputStream, Delta]]:
        """Deltas of all choices as they come, tagged with the choice's index."""
        with self.admission.admit(len(choices)):
            async with aclosing(self._stream(choices)) as items:  # aborts them on close
                async for item in items:
                    yield item

    async def _stream(self, choices: list[Choice]
                      ) -> AsyncIterator[tuple[int, OutputStream, Delta]]:
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
