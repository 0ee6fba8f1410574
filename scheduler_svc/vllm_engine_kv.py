"""KV cache events on the VllmEngine protocol's SubscribeKvEvents stream: the same
block events the ZMQ publisher sends (scheduler_svc/kv_events.py), as
`smg.grpc.common.KvEventBatch`es, so a gateway's cache-aware policy indexes our
prefix cache without a ZMQ socket.

The engine loop hands each step's events to publish() (through Fanout, beside the
ZMQ publisher); publish() numbers the batch and puts it on every subscriber's
bounded queue without blocking. Nothing is recorded or built until the first
subscriber comes (`start_recording`): a deployment without a gateway pays nothing. A subscriber that falls `max_queue` batches behind
loses batches (counted, and its stream sees the sequence gap); the last
`buffer_batches` are kept so a resubscribing gateway can replay from its last
sequence number.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque

from smg_grpc_proto.generated import common_pb2 as cpb

from scheduler_svc.core.block_pool import BlocksRemoved, BlocksStored, CacheCleared
from scheduler_svc.kv_events import external_hash
from scheduler_svc.metrics import KV_EVENTS_DROPPED, KV_EVENTS_PUBLISHED
from shared.telemetry import get_logger

log = get_logger(service="scheduler")

ENDED = object()  # the last item of a subscriber's queue: the server is stopping


def signed64(value: int) -> int:
    """The protocol's block hashes are int64; ours are the digest's low 64 bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def event_to_proto(event, block_size: int, event_id: int) -> cpb.KvCacheEvent:
    if isinstance(event, BlocksStored):
        stored = cpb.KvBlocksStored(tier=cpb.KV_CACHE_TIER_DEVICE, medium="GPU", group_idx=0,
                                    kv_cache_spec_kind="full_attention")
        if event.parent_block_hash is not None:
            stored.parent_block_hash = signed64(external_hash(event.parent_block_hash))
        for i, digest in enumerate(event.block_hashes):
            stored.blocks.add(block_hash=signed64(external_hash(digest)), block_size=block_size,
                              token_ids=event.token_ids[i * block_size:(i + 1) * block_size])
        return cpb.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlocksRemoved):
        return cpb.KvCacheEvent(event_id=event_id, removed=cpb.KvBlocksRemoved(
            block_hashes=[signed64(external_hash(h)) for h in event.block_hashes],
            tier=cpb.KV_CACHE_TIER_DEVICE, medium="GPU", group_idx=0))
    if isinstance(event, CacheCleared):
        return cpb.KvCacheEvent(event_id=event_id, cleared=cpb.KvCacheCleared())
    raise TypeError(f"not a KV cache event: {event!r}")


class KvEventStreams:
    """The gRPC subscribers' publisher; publish() is called by the engine loop only."""

    def __init__(self, block_size: int, model_name: str = "", max_queue: int = 10_000,
                 buffer_batches: int = 10_000, start_recording=None) -> None:
        self.block_size = block_size
        self._start_recording = start_recording  # () -> None: the core records from now on
        self._active = False  # a subscriber came: number, keep and send every batch
        self.max_queue = max_queue
        # Numbered from the start time in microseconds, not 1: a gateway that resubscribes
        # to a restarted scheduler asks for its last number + 1, and must get the new
        # batches rather than skip them as already seen.
        self._seq = itertools.count(time.time_ns() // 1000)
        self._event_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._subscribers: set[queue.Queue] = set()
        self._buffer: deque[cpb.KvEventBatch] = deque(maxlen=buffer_batches)
        self._published = KV_EVENTS_PUBLISHED.labels(model_name)
        self._dropped = KV_EVENTS_DROPPED.labels(model_name)

    def publish(self, events: list) -> None:
        if not events or not self._active:
            return
        batch = cpb.KvEventBatch(
            sequence_number=next(self._seq), timestamp=time.time(),
            events=[event_to_proto(e, self.block_size, next(self._event_ids)) for e in events])
        with self._lock:
            self._buffer.append(batch)
            subscribers = list(self._subscribers)
        for q in subscribers:
            try:
                q.put_nowait(batch)
                self._published.inc(len(events))
            except queue.Full:
                self._dropped.inc(len(events))

    def subscribe(self, start_sequence_number: int = 0) -> queue.Queue:
        """A queue of batches from now on, after the kept ones numbered from
        `start_sequence_number` (0: none replayed)."""
        q: queue.Queue = queue.Queue(maxsize=self.max_queue)
        if not self._active:
            if self._start_recording is not None:
                self._start_recording()
            self._active = True  # kept on: a gateway that resubscribes replays from here
        with self._lock:
            if start_sequence_number:
                for batch in self._buffer:
                    if batch.sequence_number >= start_sequence_number and not q.full():
                        q.put_nowait(batch)
            self._subscribers.add(q)
        log.info("kv_events_subscribed", subscribers=len(self._subscribers),
                 replayed=q.qsize(), start_sequence_number=start_sequence_number)
        return q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self._lock:
            self._subscribers.discard(q)

    def end(self, q: queue.Queue) -> None:
        """Stop feeding one subscriber and wake its reader."""
        self.unsubscribe(q)
        while True:
            try:
                q.put_nowait(ENDED)
                return
            except queue.Full:  # a reader that fell behind: what it has not read is moot
                try:
                    q.get_nowait()
                except queue.Empty:
                    pass

    def close(self) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for q in subscribers:
            self.end(q)


class Fanout:
    """The engine's one kv_events publisher, passing each step's events to several."""

    def __init__(self, *publishers) -> None:
        self.publishers = [p for p in publishers if p is not None]

    def publish(self, events: list) -> None:
        for publisher in self.publishers:
            publisher.publish(events)

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()
