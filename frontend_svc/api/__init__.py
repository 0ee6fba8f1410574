"""The doors clients come through.

    openai_api.py      the OpenAI-compatible routes      openai_format.py  their bodies
    protocol.py        request schemas (pydantic)        http_util.py      errors, disconnects
    grpc_api.py        generate.proto's Generation service
    auth.py            API keys and priority keys        http_guard.py  401/413/early 429 (ASGI)
    router_compat.py   /server_info, /model_info, /get_load for sglang-router in front
"""
