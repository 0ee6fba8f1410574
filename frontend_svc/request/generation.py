"""One choice of one request, end to end inside the frontend: send it to the
scheduler, turn its outputs into text deltas, and make sure it ends there too.

`stream()` is an async generator: whoever consumes it must close it (use
contextlib.aclosing), so that a client that goes away (HTTP disconnect, gRPC
cancel: both arrive as CancelledError) aborts the request at the scheduler; the
scheduler frees its KV blocks in its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from frontend_svc.request.detokenizer import IncrementalDetokenizer
from frontend_svc.engine.engine_client import EngineClient
from frontend_svc.errors import EngineError
from frontend_svc.telemetry.observe import Observer
from frontend_svc.request.output_stream import Delta, OutputStream
from frontend_svc.request.stops import StopStrings
from frontend_svc.request.tokenizer import TextTokenizer
from frontend_svc.request.choice import Choice


def new_state(tokenizer: TextTokenizer, choice: Choice) -> OutputStream:
    inp = choice.inp
    detok = IncrementalDetokenizer.for_prompt(tokenizer.fast, inp.prompt_token_ids,
                                              inp.skip_special_tokens)
    return OutputStream(choice, detok, StopStrings(inp.stops), inp.include_stop_str_in_output)


async def stream(engine: EngineClient, tokenizer: TextTokenizer, choice: Choice,
                 observer: Observer) -> AsyncIterator[tuple[OutputStream, Delta]]:
    """Deltas of one choice until it finishes; raises EngineError on a scheduler error."""
    choice.start()
    state = new_state(tokenizer, choice)
    tracker = observer.start(choice, engine)
    gone_at_scheduler = False
    try:
        choice.trace_context = tracker.carrier()
        queue = engine.add(choice)
        while not state.finished:
            delta = _merge(state, _take_all(await queue.get(), queue), tracker)
            if state.needs_abort:  # a stop string ended it here first
                engine.abort([choice.req_id])
                state.needs_abort = False
            yield state, delta
        engine.release(choice.req_id)
        observer.finish(tracker)
    except EngineError as exc:
        gone_at_scheduler = True
        observer.fail(tracker, exc.code.name, exc.message)
        raise
    finally:
        if not state.finished and not gone_at_scheduler:  # the client went away
            engine.abort([choice.req_id])
            observer.fail(tracker, grpc.StatusCode.CANCELLED.name, "the client went away")


def _take_all(first, queue: asyncio.Queue) -> list:
    """Everything already queued: a slow reader catches up in one delta."""
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _merge(state: OutputStream, items: list, tracker) -> Delta:
    merged = Delta([], "", [])
    for item in items:
        if isinstance(item, EngineError):
            raise item
        delta = state.process(item)
        tracker.on_output(item)
        tracker.on_tokens(len(delta.token_ids))
        merged.token_ids += delta.token_ids
        merged.text += delta.text
        merged.logprobs += delta.logprobs
        merged.finish_reason = delta.finish_reason
        merged.stop_reason = delta.stop_reason
        if delta.finished:
            break
    return merged

