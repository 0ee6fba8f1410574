"""Block tables of requests on top of the block pool: allocation of slots for new
tokens, prefix-cache lookup, freeing, and usage/hit statistics.

With a sliding window shared by every attention layer (`sliding_window` > 0), blocks
wholly behind the window of a running request's next token are freed as it advances
(shared/kv_window.py): its table keeps its length, the freed entries become the null
block, and a prefix hit needs only the blocks inside the window of its end
(docs/scheduling.md, "Sliding-window models")."""

from __future__ import annotations

from scheduler_svc.core.block_pool import BlockPool, BlocksStored, KVBlock
from scheduler_svc.core.request import Request
from shared.kv_window import first_needed_position

NO_BLOCKS: tuple[KVBlock, ...] = ()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_prefix_caching: bool = True, sliding_window: int = 0,
                 lookback: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        # every layer's window (0: some layer sees every key, nothing is freed early);
        # lookback: positions a request may step back (rejected draft slots)
        self.sliding_window = sliding_window
        self.lookback = lookback
        self.num_window_freed_blocks = 0  # cumulative: blocks freed behind a window

    def resize(self, num_blocks: int) -> None:
        """A new, empty pool of num_blocks (the workers' KV was lost with them); only
        when no request holds a block. Recorded events carry over to the listeners."""
        if self.req_to_blocks:
            raise RuntimeError(f"cannot resize the KV pool while {len(self.req_to_blocks)} "
                               "requests hold blocks")
        events, self.pool = self.pool.events, BlockPool(num_blocks)
        self.pool.events = events

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest chain of cached full blocks matching the request's tokens, never
        covering the last token (it is recomputed to produce logits)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window:
            return self._windowed_hit(request, max_blocks)
        hit: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def _windowed_hit(self, request: Request, max_blocks: int) -> tuple[list[KVBlock], int]:
        """A sliding-window model's hit (vLLM's rule): the longest prefix whose last
        blocks, those the window of the next token reaches, are all cached; the blocks
        before them are not needed and stand as the null block. A block's hash chains
        every token before it, so its presence alone proves the whole prefix matches."""
        hashes = request.block_hashes
        pool = self.pool
        size = self.block_size
        end = max_blocks  # candidate hit: blocks [0, end)
        while end > 0:
            first = first_needed_position(end * size, self.sliding_window,
                                          self.lookback) // size
            i = end - 1
            while i >= first and pool.get_cached_block(hashes[i]) is not None:
                i -= 1
            if i < first:  # every block the window reaches is cached
                return ([pool.null_block] * first
                        + [pool.get_cached_block(h) for h in hashes[first:end]], end * size)
            end = i  # block i is missing: no hit reaches past it
        return [], 0

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def blocks_needed(self, request: Request, num_tokens_total: int,
                      num_new_computed_blocks: int = 0) -> int:
        held = len(self.req_to_blocks.get(request.req_id, NO_BLOCKS)) + num_new_computed_blocks
        return max(0, -(-min(num_tokens_total, self.max_model_len) // self.block_size) - held)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | tuple = NO_BLOCKS,
                       num_lookahead_tokens: int = 0) -> list[KVBlock] | None:
        """Give the request blocks for `num_new_tokens` (+ lookahead) beyond what it has
        computed (including `new_computed_blocks`, a prefix hit being admitted). Returns
        the newly allocated blocks, or None (changing nothing) if they do not fit."""
        req_id = request.req_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks and self.sliding_window:  # first give back what its window left behind
            self._free_behind_window(blocks, request.num_computed_tokens)
        num_held = len(blocks) if blocks is not None else 0
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_needed = -(-num_total // self.block_size) - num_held - len(new_computed_blocks)
        if num_needed <= 0 and not new_computed_blocks:  # the common decode step: no new block
            return []
        num_needed = max(num_needed, 0)
        # Prefix-hit blocks sitting in the free queue are taken out of it, so they count
        # (the null block standing for a windowed hit's unneeded blocks never is free).
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed + num_evictable_hits > self.pool.num_free_blocks:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = 0
        if new_computed_blocks:
            null = self.pool.null_block
            self.pool.touch(b for b in new_computed_blocks if b is not null)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[req_id] = len(blocks)  # already in the cache
        new_blocks = self.pool.get_new_blocks(num_needed)
        blocks.extend(new_blocks)
        return new_blocks

    def _free_behind_window(self, blocks: list[KVBlock], num_computed_tokens: int) -> None:
        """Free the blocks wholly behind the window of the next token to compute (its
        position is num_computed_tokens); each becomes the null block in the table, which
        keeps its length (entry i stays block i's). A freed block keeps its hash if it
        has one (a later request may hit it); one not yet hashed (its step is still in
        flight) is never hashed: cache_computed_blocks skips null entries. The worker's
        attention starts at the window too, so it never reads a freed block's entry."""
        end = first_needed_position(num_computed_tokens, self.sliding_window,
                                    self.lookback) // self.block_size
        end = min(end, len(blocks))
        null = self.pool.null_block
        if end == 0 or blocks[end - 1] is null:  # the common case: nothing new behind it
            return
        start = end - 1
        while start > 0 and blocks[start - 1] is not null:
            start -= 1
        freed = blocks[start:end]
        blocks[start:end] = [null] * (end - start)
        self.pool.free_blocks(freed)  # oldest first: evicted first
        self.num_window_freed_blocks += end - start

    def cache_computed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full within its first
        `num_computed_tokens` tokens. Called only when the step that computed them is
        committed (its output applied): a hash must never point at KV that was not
        written, and a refunded or dropped step writes nothing. Only hashes of committed
        tokens exist, so a block that ends in a placeholder waits for its token."""
        if not self.enable_prefix_caching:
            return
        req_id = request.req_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return
        done = self.num_cached_blocks[req_id]
        upto = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if upto <= done:
            return
        hashes = request.block_hashes
        events = self.pool.events
        null = self.pool.null_block
        run_start = None  # first block of the current run of newly cached blocks
        for i in range(done, upto):
            if blocks[i] is not null and self.pool.cache_block(blocks[i], hashes[i]):
                if run_start is None:
                    run_start = i
            elif run_start is not None and events is not None:
                events.append(self._stored(request, run_start, i))
                run_start = None
        if run_start is not None and events is not None:
            events.append(self._stored(request, run_start, upto))
        self.num_cached_blocks[req_id] = upto

    def _stored(self, request: Request, start: int, end: int) -> BlocksStored:
        """Blocks [start, end) of the request entered the cache. A block whose hash
        another block already held is left out (its hash is announced once), which
        splits a step's blocks into runs, each naming its parent."""
        size = self.block_size
        return BlocksStored(request.block_hashes[start:end],
                            request.block_hashes[start - 1] if start else None,
                            request.all_token_ids[start * size:end * size])

    def record_events(self) -> None:
        """Start recording the prefix cache's changes (KV cache events) for take_events."""
        if self.pool.events is None:
            self.pool.events = []

    def take_events(self) -> list:
        """The changes recorded since the last call, oldest first; [] when not recording."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def free(self, request: Request) -> None:
        """Release the request's blocks, deepest first, so its longest prefix is evicted first."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_blocks.pop(request.req_id, None)
        if blocks:
            null = self.pool.null_block  # a window's freed entries: given back already
            self.pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, NO_BLOCKS)]
