"""The worker endpoints sglang-router (the SGLang Model Gateway, `sglang-router` on
PyPI) calls besides the OpenAI ones, so that gapserve replicas can stand behind it
as its "regular" HTTP workers.

What sglang-router 0.3.2 asks of a worker (seen on loopback, docs/deploy.md):

- `GET /health` at registration and then every --health-check-interval-secs: the
  operator router's own route, nothing here.
- `GET /server_info`, falling back to `/get_server_info` on a 404, once at
  registration: the router takes the worker's model id (`served_model_name`,
  `model_path`) and its capacity from it. Without it every replica registers as
  model "unknown", and the router's /v1/models lists that name.
- `GET /model_info`, falling back to `/get_model_info`, at registration.
- `GET /get_load` for its power_of_two policy (a LoadMonitor polls it) and its own
  `GET /get_loads`: one entry per data-parallel rank with `num_tokens`, the load
  it compares.

Every value is the replica's own: the scheduler's model info and live status, and
the checkpoint's config.json. What we do not have is refused, never imitated:
`POST /flush_cache` answers 501 (gapserve has no call that drops its prefix cache),
and SGLang's native `/generate` stays a 404 (clients use the OpenAI routes).

Each call is counted (`gapserve:router_probes`, by endpoint), so an operator sees
from a replica's /metrics whether a router registered it and is polling it."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from frontend_svc.context import Frontend
from frontend_svc.errors import EngineError, error_body
from frontend_svc.observe import log

ROUTER_PROBES = Counter("gapserve:router_probes",
                        "Calls of the worker endpoints a router (sglang-router) makes "
                        "besides the OpenAI ones, by endpoint (frontend_svc/router_compat.py).",
                        ["model_name", "endpoint"])
NOT_CONNECTED = "the scheduler or its workers are not connected"


def router_compat_router(fe: Frontend) -> APIRouter:
    router = APIRouter()

    @router.get("/server_info", response_model=None)
    @router.get("/get_server_info", response_model=None)
    async def server_info() -> dict | JSONResponse:
        _count(fe, "server_info")
        if fe.engine.model_info is None:
            return JSONResponse(error_body(NOT_CONNECTED, 503), 503)
        try:
            status = await fe.engine.get_status()
        except EngineError as exc:
            return JSONResponse(error_body(exc.message, exc.http_status), exc.http_status)
        body = server_info_body(fe, status)
        # registration is rare and worth a line: which router-facing identity we gave
        log.info("router probe: server_info", served_model_name=body["served_model_name"],
                 max_running_requests=body["max_running_requests"],
                 max_total_tokens=body["max_total_tokens"])
        return body

    @router.get("/model_info", response_model=None)
    @router.get("/get_model_info", response_model=None)
    async def model_info() -> dict | JSONResponse:
        _count(fe, "model_info")
        if fe.engine.model_info is None:
            return JSONResponse(error_body(NOT_CONNECTED, 503), 503)
        return model_info_body(fe)

    @router.get("/get_load", response_model=None)
    async def get_load() -> list | JSONResponse:
        _count(fe, "get_load")
        if fe.engine.model_info is None:
            return JSONResponse(error_body(NOT_CONNECTED, 503), 503)
        try:
            status = await fe.engine.get_status()
        except EngineError as exc:
            return JSONResponse(error_body(exc.message, exc.http_status), exc.http_status)
        return [load_entry(status, fe.engine.model_info.block_size, dp_rank=0)]

    @router.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        _count(fe, "flush_cache")
        return JSONResponse(error_body(
            "gapserve cannot flush its prefix cache on request: cached blocks are "
            "evicted by LRU as the pool needs them (docs/scheduling.md)", 501), 501)

    return router


def _count(fe: Frontend, endpoint: str) -> None:
    ROUTER_PROBES.labels(fe.served_model_name, endpoint).inc()


def model_info_body(fe: Frontend) -> dict:
    """SGLang's /model_info keys that we can fill truthfully."""
    info = fe.engine.model_info
    config = _checkpoint_config(fe.model_path)
    return {
        "model_path": fe.model_path,
        "tokenizer_path": fe.model_path,  # the tokenizer ships in the checkpoint directory
        "served_model_name": fe.served_model_name,
        "is_generation": True,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "max_context_length": info.max_model_len,
        "vocab_size": info.vocab_size,
        "eos_token_ids": list(info.eos_token_ids),
    }


def server_info_body(fe: Frontend, status) -> dict:
    """SGLang's /server_info keys (its server arguments) that have a gapserve value:
    context_length is --max-model-len, max_running_requests --max-num-seqs,
    max_prefill_tokens the step token budget, max_total_tokens the KV pool in tokens,
    page_size the KV block size."""
    info = fe.engine.model_info
    return {
        **model_info_body(fe),
        "context_length": info.max_model_len,
        "dp_size": 1,  # one scheduler behind this frontend: one rank in /get_load
        "max_running_requests": status.max_num_seqs,
        "max_prefill_tokens": info.max_num_batched_tokens,
        "max_total_tokens": max(status.num_kv_blocks - 1, 0) * info.block_size,
        "page_size": info.block_size,
        "version": _version(),
        "engine": "gapserve",
    }


def load_entry(status, block_size: int, dp_rank: int) -> dict:
    """One rank's load as SGLang's /get_load reports it: requests running plus
    waiting, those waiting, and the KV tokens held (blocks in use x block size;
    block 0 is the reserved null block, docs/scheduling.md)."""
    used_blocks = max(status.num_kv_blocks - 1 - status.num_free_blocks, 0)
    return {"dp_rank": dp_rank,
            "num_reqs": status.num_running + status.num_waiting,
            "num_waiting_reqs": status.num_waiting,
            "num_tokens": used_blocks * block_size}


def _checkpoint_config(model_path: str) -> dict:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _version() -> str:
    try:
        return metadata.version("gapserve")
    except metadata.PackageNotFoundError:
        return "unknown"
