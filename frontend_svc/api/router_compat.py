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

import asyncio
import json
from importlib import metadata
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from frontend_svc.request.context import Frontend
from frontend_svc.errors import EngineError, error_body
from frontend_svc.telemetry.observe import log

ROUTER_PROBES = Counter("gapserve:router_probes",
                        "Calls of the worker endpoints a router (sglang-router) makes "
                        "besides the OpenAI ones, by endpoint (frontend_svc/api/router_compat.py).",
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
        statuses = await _statuses(fe)
        if not statuses:
            return JSONResponse(error_body(NOT_CONNECTED, 503), 503)
        body = server_info_body(fe, statuses)
        # registration is rare and worth a line: which router-facing identity we gave
        log.info("router probe: server_info", served_model_name=body["served_model_name"],
                 dp_size=body["dp_size"], max_running_requests=body["max_running_requests"],
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
        statuses = await _statuses(fe)
        if not statuses:  # an empty list would read as "no load"
            return JSONResponse(error_body(NOT_CONNECTED, 503), 503)
        block_size = fe.engine.model_info.block_size
        return [load_entry(status, block_size, rank) for rank, status in sorted(statuses.items())]

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


def server_info_body(fe: Frontend, statuses: dict[int, object]) -> dict:
    """SGLang's /server_info keys (its server arguments) that have a gapserve value:
    context_length is --max-model-len, max_running_requests --max-num-seqs,
    max_prefill_tokens the step token budget, max_total_tokens the KV pool in tokens,
    page_size the KV block size; dp_size the schedulers behind this frontend, the
    capacities summed over those that answered."""
    info = fe.engine.model_info
    return {
        **model_info_body(fe),
        "context_length": info.max_model_len,
        "dp_size": len(_engines(fe)),
        "max_running_requests": sum(s.max_num_seqs for s in statuses.values()),
        "max_prefill_tokens": info.max_num_batched_tokens,
        "max_total_tokens": sum(max(s.num_kv_blocks - 1, 0)
                                for s in statuses.values()) * info.block_size,
        "page_size": info.block_size,
        "version": package_version(),
        "engine": "gapserve",
    }


def _engines(fe: Frontend) -> list:
    """The scheduler clients behind this frontend: one, or with --scheduler-addresses
    one per data-parallel replica (frontend_svc/engine/replicas.py), in rank order."""
    replicas = getattr(fe.engine, "replicas", None)
    return [r.client for r in replicas] if replicas else [fe.engine]


async def _statuses(fe: Frontend) -> dict[int, object]:
    """Each connected scheduler's live EngineStatus by rank; one that does not
    answer is left out (a router sums what is there)."""
    engines = _engines(fe)
    replies = await asyncio.gather(*(e.get_status() for e in engines), return_exceptions=True)
    out = {}
    for rank, reply in enumerate(replies):
        if isinstance(reply, EngineError):
            log.warning("router probe: a scheduler did not answer", rank=rank,
                        error=reply.message)
        elif isinstance(reply, BaseException):
            raise reply
        else:
            out[rank] = reply
    return out


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


def package_version() -> str:
    try:
        return metadata.version("gapserve")
    except metadata.PackageNotFoundError:
        return "unknown"
