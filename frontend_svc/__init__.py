"""The frontend: owns text. Clients talk to it; it talks token ids to the scheduler.

    server.py     `gapserve frontend`: HTTP (uvicorn) + client gRPC in one loop
    errors.py     the error vocabulary of every package: OpenAI's error JSON, field
                  errors, scheduler gRPC codes -> HTTP
    api/          the doors: OpenAI routes and bodies, the gRPC Generation service,
                  request schemas, errors, auth, HTTP guards, router compatibility
    request/      one request's life: validation and translation at the door, its
                  choices, generation, output text (detokenizer, stops), bounds
    engine/       the scheduler side: the Session stream, continuation, readiness,
                  drain, and data parallelism (replicas, routing, the KV index)
    structured/   structured outputs, tools and their parsers, chat templates
    telemetry/    metrics (gapserve:* and vLLM's vllm:*) and the hooks that feed them

The doors (api/) call into request/, which talks to engine/; structured/ and
telemetry/ serve all three. A module finds a route, a rule or a metric by its folder.
"""
