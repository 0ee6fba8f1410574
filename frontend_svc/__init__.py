"""The frontend: owns text. Clients talk to it; it talks token ids to the scheduler.

    server.py          `gapserve frontend`: HTTP (uvicorn) + client gRPC in one loop
    openai_api.py      the OpenAI-compatible routes      openai_format.py  their bodies
    protocol.py        request schemas (pydantic)        http_util.py      errors, disconnects
    grpc_api.py        generate.proto's Generation service
    translate.py       validation at the door: request -> prompt ids, SamplingParams, stops
    context.py         what both APIs share; runs a request's n choices
    generation.py      one choice: add, stream deltas, abort when the client goes away
    engine_client.py   the one Session stream to the scheduler, routed per request
    output_stream.py   token ids -> text deltas, stop strings, usage, timings
    detokenizer.py     incremental detokenization    stops.py   stop strings and holdback
    tokenizer.py       tokenizer + chat template (chat_template.py), no transformers/torch
    observe.py         every telemetry hook (metrics.py holds the metric objects)
    auth.py            API keys and priority keys     http_guard.py  401/413/early 429 (ASGI)
    caps.py            per-request bounds (400)       admission.py   --max-queued-requests (429)
    drain.py           SIGTERM: /ready 503, new requests 503, open streams end cleanly
"""
