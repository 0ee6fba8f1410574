"""KV cache events on the wire: vLLM's structs (vllm/distributed/kv_events.py), field
for field, declared once for both ends: the scheduler's publisher
(scheduler_svc/kv_events.py) and the frontend's subscriber (frontend_svc/kv_subscriber.py).
A block hash is vLLM's ExternalBlockHash, `int | bytes`: ours are ints; a subscriber
decoding another engine's batches takes either (docs/kv_events.md)."""

from __future__ import annotations

from typing import Any

import msgspec

# current vLLM: the batch is an array, each event a map tagged by its class name under
# "type"; defaults are omitted


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
