"""The KV block pool: reference counts, a free queue that is also an LRU, and the map
from block hash to cached block (the prefix cache).

Allocation takes from the head of the free queue. A freed block without a hash goes
to the head (reused first); a freed block with a hash goes to the tail (evicted last)
and keeps its hash until it is handed out again (lazy eviction), so a later request
can still hit it. Block 0 is the reserved null block and never enters the queue.

With `events` set to a list, the pool records each change of its hash set there
(the service layer drains it after each step and publishes it, scheduler_svc/kv_events.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class BlocksStored:
    """Full blocks of one request, consecutive in its hash chain, entered the cache.
    `parent_block_hash` is the hash of the block before the first (None: the chain's start)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]


@dataclass(slots=True)
class BlocksRemoved:
    """Hashes left the cache (their blocks were handed out again: lazy eviction)."""

    block_hashes: list[bytes]


@dataclass(slots=True)
class CacheCleared:
    """Every hash left the cache (the workers' KV is gone)."""


class KVBlock:
    """One block; `prev`/`next` link it into the free queue while its ref_cnt is 0."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list between two sentinels: a prefix hit takes a cached
    block out of the middle in O(1), and no Python object is allocated per operation."""

    __slots__ = ("head", "tail", "num_free")

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next = self.tail
        self.tail.prev = self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self.head.next
        if block is self.tail:
            raise RuntimeError("no free KV blocks")  # callers check num_free first
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev
        last.next = block
        block.prev = last
        block.next = self.tail
        self.tail.prev = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self.head.next
        first.prev = block
        block.next = first
        block.prev = self.head
        self.head.next = block
        self.num_free += 1

    def __iter__(self):
        block = self.head.next
        while block is not self.tail:
            yield block
            block = block.next


class BlockPool:
    __slots__ = ("num_blocks", "blocks", "free_queue", "cached", "null_block", "events")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (block 0 is reserved), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # held forever by the pool itself
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.events: list | None = None  # None: nobody listens, nothing is recorded

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        evicted = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # lazy eviction happens here
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.events is not None:
            self.events.append(BlocksRemoved(evicted))
        return out

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a full block; the first block to reach a hash keeps it. Returns
        whether the hash entered the cache now."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def forget_cached(self) -> None:
        """Drop every prefix-cache entry: the workers' KV contents are gone (a worker
        was replaced). Held blocks stay held; only their hashes go."""
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(CacheCleared())
