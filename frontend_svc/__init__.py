"""The frontend: owns text. Clients talk to it; it talks token ids to the scheduler.

    server.py          `gapserve frontend`: HTTP (uvicorn) + client gRPC in one loop
    openai_api.py      the OpenAI-compatible routes      openai_format.py  their bodies
    protocol.py        request schemas (pydantic)        http_util.py      errors, disconnects
    errors.py          OpenAI's error JSON, scheduler gRPC codes -> HTTP
    grpc_api.py        generate.proto's Generation service
    translate.py       validation at the door: request -> prompt ids, SamplingParams, stops
    context.py         what both APIs share; runs a request's n choices
    generation.py      one choice: add, stream deltas, abort when the client goes away
    engine_client.py   the one Session stream to a scheduler, routed per request
    continuation.py    open requests kept so they resume on a new scheduler or replica
    readiness.py       /ready and gRPC health follow the scheduler's health
    output_stream.py   token ids -> text deltas, stop strings, usage, timings
    detokenizer.py     incremental detokenization    stops.py   stop strings and holdback
    tokenizer.py       tokenizer + chat template (chat_template.py), no transformers/torch
    templates/         shipped chat templates (smollm2_tools.jinja: SmolLM2 with tools)
    structured.py      response_format / structured_outputs / guided_* -> one checked spec
    tools.py           tools, tool_choice -> the template, grammar and parser to use
    tool_parsers.py    tool calls out of the reply text, streamed (hermes, llama3_json, ...)
    json_scan.py       an incremental JSON object scanner for the tool-call parsers
    observe.py         every telemetry hook (metrics.py holds the metric objects)
    vllm_metrics.py    vLLM's vllm:* series on /metrics beside gapserve:*
    auth.py            API keys and priority keys     http_guard.py  401/413/early 429 (ASGI)
    caps.py            per-request bounds (400)       admission.py   --max-queued-requests (429)
    drain.py           SIGTERM: /ready 503, new requests 503, open streams end cleanly

  data parallelism (docs/scale_out.md):
    replicas.py        a Session per replica behind one EngineClient; failover
    replica_router.py  the routing rule (kv-aware as SGLang's cache_aware, round-robin)
    kv_index.py        which prompt prefixes a replica holds, keyed by token ids
    kv_subscriber.py   one replica's KV cache events (ZMQ SUB) -> its kv_index
    router_compat.py   /server_info, /model_info, /get_load for sglang-router in front
"""
