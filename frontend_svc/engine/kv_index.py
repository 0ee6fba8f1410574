"""Which prompt prefixes one replica holds in its prefix cache, as its KV cache
events say (docs/kv_events.md), for the frontend's routing (frontend_svc/engine/replica_router.py).

A scheduler's block hashes cannot be recomputed here: its hash chain starts from a
seed that is secret to that scheduler process (scheduler_svc/core/block_hash.py).
So the index keys blocks by their token ids, as docs/kv_events.md tells routers to:
a `BlockStored` names its parent block and carries exactly `block_size` token ids
per block, so each of the replica's hashes maps to a key of ours, the chain of
token blocks from the start of the prompt (`block_keys`). A prompt then matches
the leading run of its block keys present here.

The cache salt (the prefix-cache scope per API key, the client's cache_salt) is not
in the events (docs/kv_events.md, "Limits"): two salts holding the same tokens are
one key here, counted twice. Routing on it may send a request where its tokens sit
under another salt: a missed hit there, never wrong KV, and nothing a client can see.

A prompt routed here counts as held from that moment (`expect`), for as long as the
request is open here and `GRACE_S` after it ended (`settle`), unless the replica's
events confirm its blocks first: a burst of users of one new prefix then lands
together, as SGLang's router does by inserting the routed text into its tree, and a
slow first prefill (seconds on a loaded machine) cannot make the hold run out while
the prefix is still being computed. The blocks held this way also count in `size`,
the cache size a miss compares (frontend_svc/engine/replica_router.py, rule 3).

Sequence numbers: the subscriber (frontend_svc/engine/kv_subscriber.py) feeds batches in
order through `accept_seq`, which says whether the batch is the next one, a gap
to replay, a repeat to skip, or a restarted publisher (numbers from 0 again).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from dataclasses import dataclass, field

ROOT_KEY = hashlib.sha256(b"gapserve-frontend-block-keys").digest()[:16]
GRACE_S = 5.0  # after its request ended, how long a routed prefix waits for its events
OPEN = float("inf")  # held while a request routed here with the block is open


def block_keys(token_ids: list[int], block_size: int) -> list[bytes]:
    """Our key for each full block of a prompt: a chain over the token ids, like the
    scheduler's (fixed-width ids, so no separators), without its seed and salt."""
    keys, parent = [], ROOT_KEY
    for i in range(len(token_ids) // block_size):
        parent = hashlib.sha256(
            parent + array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        ).digest()[:16]
        keys.append(parent)
    return keys


@dataclass(slots=True)
class KvIndex:
    """One replica's cached blocks. Plain state, no I/O: tested without a network."""

    block_size: int
    key_of: dict[int, bytes] = field(default_factory=dict)  # the replica's hash -> our key
    count: dict[bytes, int] = field(default_factory=dict)  # our key -> hashes holding it
    # routed here, not yet in an event: until when it counts as held (OPEN while a
    # request routed here holds it)
    expected: dict[bytes, float] = field(default_factory=dict)
    holders: dict[bytes, int] = field(default_factory=dict)  # key -> open requests routed here
    _grace: deque = field(default_factory=deque)  # (until, key), in order of settling
    last_seq: int | None = None
    num_unplaced: int = 0  # stored blocks whose parent we never saw (a lost event)
    num_resets: int = 0

    # ---- events

    def stored(self, block_hashes: list, parent, token_ids: list[int],
               block_size: int) -> None:
        if block_size != self.block_size:  # another block size: our keys cannot match
            self.num_unplaced += len(block_hashes)
            return
        key = ROOT_KEY if parent is None else self.key_of.get(parent)
        if key is None:  # its parent's event was lost: this chain cannot be placed
            self.num_unplaced += len(block_hashes)
            return
        for i, h in enumerate(block_hashes):
            key = hashlib.sha256(
                key + array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
            ).digest()[:16]
            if h in self.key_of:  # announced again: keep one count per hash
                continue
            self.key_of[h] = key
            self.count[key] = self.count.get(key, 0) + 1
            self.expected.pop(key, None)  # confirmed

    def removed(self, block_hashes: list) -> None:
        for h in block_hashes:
            key = self.key_of.pop(h, None)
            if key is None:
                continue
            left = self.count[key] - 1
            if left:
                self.count[key] = left
            else:
                del self.count[key]

    def cleared(self) -> None:
        """AllBlocksCleared, a restarted replica, or a gap replay cannot fill. Prompts
        of requests still open here stay expected: they are (re)computed here."""
        self.key_of.clear()
        self.count.clear()
        self.expected = dict.fromkeys(self.holders, OPEN)
        self._grace.clear()
        self.num_resets += 1

    def accept_seq(self, seq: int) -> str:
        """Where a batch's sequence number stands: "next" (apply it), "repeat" (seen,
        skip), "gap" (earlier batches are missing: replay them first) or "restart"
        (the publisher counts from 0 again: a new scheduler, whose cache is empty)."""
        last = self.last_seq
        if last is None:  # the first batch: a late joiner replays what it missed
            return "next" if seq == 0 else "gap"
        if seq == last + 1:
            return "next"
        if seq == 0 and last > 0:
            return "restart"
        if seq <= last:
            return "repeat"
        return "gap"

    # ---- routing

    def match(self, keys: list[bytes], now: float) -> int:
        """How many leading blocks of a prompt this replica holds (or was just sent)."""
        self._expire(now)
        n = 0
        for key in keys:
            if key not in self.count and key not in self.expected:
                break
            n += 1
        return n

    def expect(self, keys: list[bytes]) -> None:
        """A request with this prompt was routed here: its blocks count as held until
        its events come, for as long as it is open (settle() ends that)."""
        for key in keys:
            self.holders[key] = self.holders.get(key, 0) + 1
            if key not in self.count:
                self.expected[key] = OPEN

    def settle(self, keys: list[bytes], now: float) -> None:
        """The request expect() was called for ended here (finished, aborted, moved):
        blocks its events have not confirmed yet stay expected GRACE_S longer (the
        events of its last step may still be on their way), then no more."""
        until = now + GRACE_S
        for key in keys:
            left = self.holders.get(key, 0) - 1
            if left > 0:
                self.holders[key] = left
                continue
            self.holders.pop(key, None)
            if key in self.expected:
                self.expected[key] = until
                self._grace.append((until, key))

    def _expire(self, now: float) -> None:
        grace = self._grace
        while grace and grace[0][0] <= now:
            until, key = grace.popleft()
            if self.expected.get(key) == until:
                del self.expected[key]

    def size(self, now: float) -> int:
        """Blocks held here, as its events say, plus the expected ones of prompts
        routed here: what a miss compares (SGLang's tree size)."""
        self._expire(now)
        return len(self.key_of) + len(self.expected)

    @property
    def num_blocks(self) -> int:
        return len(self.key_of)
