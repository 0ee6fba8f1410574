"""A request's CPU cost inside the frontend, without a network: one choice from
`generation.stream` (its tracker, its output stream, EngineClient.add and the
continuation record) through every scheduler output routed back
(EngineClient._route) to the last delta. The scheduler's side is simulated in
this process: a task answers each AddRequest on the outbox with --tokens
outputs of one token each. CPU time of this thread per request; the best of
--repeats runs (on a shared machine the minimum is what the code costs).

    .venv/bin/python benchmarks/frontend_request.py [--requests 300] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from contextlib import aclosing

from shared.model_files.default_model import ensure_default_model
from shared.proto import common_pb2, engine_pb2
from shared.types import ModelInfo, SamplingParams

from frontend_svc.engine.engine_client import EngineClient
from frontend_svc.request import generation
from frontend_svc.request.choice import Choice
from frontend_svc.request.tokenizer import TextTokenizer
from frontend_svc.request.translate import GenerationInput
from frontend_svc.telemetry.observe import Observer


async def answer(client: EngineClient, outbox: asyncio.Queue, tokens: list[int]) -> None:
    """The scheduler: every add gets its tokens, one output each, the last one LENGTH."""
    while True:
        msg = await outbox.get()
        if not msg.HasField("add"):
            continue
        wire_id = msg.add.request_id
        for i, token in enumerate(tokens):
            out = engine_pb2.RequestOutput(request_id=wire_id, new_token_ids=[token],
                                           num_cached_tokens=0)
            if i == len(tokens) - 1:
                out.finish_reason = common_pb2.FINISH_REASON_LENGTH
            client._route(engine_pb2.EngineResponse(outputs=[out]))
            await asyncio.sleep(0)


async def run_once(tokenizer: TextTokenizer, n: int, tokens: list[int]) -> float:
    client = EngineClient("127.0.0.1:1")  # never dialled
    client.model_info = ModelInfo("bench", 49152, 1024, [0], 1, 1, 1, "float32", 64, 16)
    outbox: asyncio.Queue = asyncio.Queue()
    client._outbox = outbox
    responder = asyncio.create_task(answer(client, outbox, tokens))
    observer = Observer("bench")
    prompt = tokenizer.encode("Tell me a story about a cat:", add_special_tokens=False)
    cpu = time.thread_time()
    for i in range(n):
        params = SamplingParams(max_tokens=len(tokens), temperature=0.0)
        choice = Choice(f"r{i}", GenerationInput(list(prompt), params), params)
        async with aclosing(generation.stream(client, tokenizer, choice, observer)) as deltas:
            async for _ in deltas:
                pass
    cpu = time.thread_time() - cpu
    responder.cancel()
    return cpu / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tokenizer = TextTokenizer.from_dir(ensure_default_model())
    tokens = tokenizer.encode(" the cat sat on the mat and looked out of the window" * 8,
                              add_special_tokens=False)[:args.tokens]
    runs = [asyncio.run(run_once(tokenizer, args.requests, tokens))
            for _ in range(args.repeats)]
    print(f"frontend CPU per request ({args.tokens} tokens): best {min(runs) * 1e6:.0f} us, "
          f"median {sorted(runs)[len(runs) // 2] * 1e6:.0f} us over {args.repeats} runs")


if __name__ == "__main__":
    main()
