"""KV cache events on the wire: vLLM's structs (vllm/distributed/kv_events.py), field
for field, declared once for both ends: the scheduler's publisher
(scheduler_svc/kv_events.py) and the frontend's subscriber (frontend_svc/engine/kv_subscriber.py).
A block hash is vLLM's ExternalBlockHash, `int | bytes`: ours are ints; a subscriber
decoding another engine's batches takes either (docs/kv_events.md).

Two layouts, as vLLM's releases sent them (docs/kv_events.md, "Wire format"):
- "map", vLLM 0.24 and later (0.33.0 is the one these fields follow): the batch a
  positional array, each event a map tagged by its class name under "type";
- "array", vLLM up to 0.23: every event a positional array too, its class name first.
Defaults are omitted in both (msgspec's omit_defaults: in an array, only trailing ones).
"""

from __future__ import annotations

from typing import Any

import msgspec

LAYOUTS = ("map", "array")


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
    locality: str | None = None  # since vLLM 0.33 (offloading tiers); never sent here
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- vLLM up to 0.23: the same events as positional arrays (their fields as in 0.23)

class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
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


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


_MAP_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(ArrayKVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch | ArrayKVEventBatch:
    """A batch in either layout (a publisher's layout is its own setting; a subscriber
    takes both). Raises msgspec.DecodeError when it is neither."""
    try:
        return _MAP_DECODER.decode(payload)
    except msgspec.ValidationError:
        return _ARRAY_DECODER.decode(payload)
