"""KV cache events in vLLM's wire format (vllm/distributed/kv_events.py), so routers
that index vLLM replicas by their prefix caches (llm-d, Dynamo, the SGLang router,
vLLM production-stack) can index a gapserve scheduler too (docs/kv_events.md).

    --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
                         "replay_endpoint": "tcp://*:5558", "topic": ""}'

The core records the prefix cache's changes into a plain list (BlockPool.events);
the engine loop drains it after each step's update and hands it to publish(), which
only numbers the batch and puts it on a bounded queue: it never blocks the loop, and
a batch that does not fit is dropped and counted (its sequence number stays unused,
so subscribers see the gap). A thread encodes and sends each batch on a ZMQ PUB
socket as (topic, 8-byte big-endian sequence number, msgpack KVEventBatch), and
keeps the last `buffer_steps` of them for the ROUTER replay socket.

The layout is current vLLM's (events as tagged maps, vLLM 0.24 and later); the key
`"event_layout": "array"`, ours, not vLLM's, sends vLLM 0.23's positional events to
routers whose decoders were written for those (docs/kv_events.md).
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

import msgspec
import zmq

from scheduler_svc.core.block_pool import BlocksRemoved, BlocksStored, CacheCleared
from scheduler_svc.core.config import ConfigError
from scheduler_svc.metrics import KV_EVENTS_DROPPED, KV_EVENTS_PUBLISHED
from shared.kv_event_wire import (LAYOUTS, AllBlocksCleared, ArrayAllBlocksCleared,
                                  ArrayBlockRemoved, ArrayBlockStored, ArrayKVEventBatch,
                                  BlockRemoved, BlockStored, KVEventBatch)
from shared.telemetry import get_logger

log = get_logger(service="scheduler")

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool, whatever the device
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay


def external_hash(digest: bytes) -> int:
    """What vLLM sends for a block hash by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1):
    the digest's low 64 bits, read big-endian."""
    return int.from_bytes(digest, "big") & 0xFFFF_FFFF_FFFF_FFFF


# per layout: the structs of BlockStored, BlockRemoved, AllBlocksCleared and the batch
_STRUCTS = {"map": (BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch),
            "array": (ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared,
                      ArrayKVEventBatch)}


def to_wire(event, block_size: int, layout: str = "map"):
    """One core event (scheduler_svc/core/block_pool.py) as vLLM's struct."""
    stored, removed, cleared, _ = _STRUCTS[layout]
    if isinstance(event, BlocksStored):
        parent = event.parent_block_hash
        return stored(
            block_hashes=[external_hash(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else external_hash(parent),
            token_ids=event.token_ids, block_size=block_size, lora_id=None,
            medium=MEDIUM_GPU, lora_name=None, group_idx=0,
            kv_cache_spec_kind="full_attention")
    if isinstance(event, BlocksRemoved):
        return removed(block_hashes=[external_hash(h) for h in event.block_hashes],
                       medium=MEDIUM_GPU, group_idx=0)
    if isinstance(event, CacheCleared):
        return cleared()
    raise TypeError(f"not a KV cache event: {event!r}")


# --- configuration: vLLM's KVEventsConfig keys and defaults

@dataclass(slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    # ours, not vLLM's: "map" (current vLLM, 0.24 on) or "array" (vLLM up to 0.23)
    event_layout: str = "map"

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    def listen_ports(self) -> list[tuple[str, int]]:
        """(host, port) of each tcp endpoint the publisher binds, for the start-up
        check of every port (a "*" port is any free one: nothing to check)."""
        out = []
        for endpoint in (self.endpoint, self.replay_endpoint) if self.enabled else ():
            if endpoint and endpoint.startswith("tcp://") and _binds(endpoint):
                host, _, port = endpoint[len("tcp://"):].rpartition(":")
                if port.isdigit():
                    out.append(("0.0.0.0" if host == "*" else host, int(port)))
        return out

    @classmethod
    def from_json(cls, text: str | None) -> KVEventsConfig:
        """The --kv-events-config value; ConfigError says what is wrong with it."""
        if text is None or not text.strip():
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--kv-events-config must be a JSON object, got "
                              f"{type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; "
                              f"known: {', '.join(known)}")
        cfg = cls(**data)
        cfg._check()
        if cfg.publisher is None:
            cfg.publisher = "zmq" if cfg.enable_kv_cache_events else "null"
        return cfg

    def _check(self) -> None:
        def want(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"--kv-events-config: {name} must be {what}, got "
                                  f"{getattr(self, name)!r}")
        want("enable_kv_cache_events", isinstance(self.enable_kv_cache_events, bool), "a boolean")
        want("publisher", self.publisher in (None, "zmq", "null"), '"zmq" or "null"')
        want("endpoint", isinstance(self.endpoint, str) and "://" in self.endpoint,
             "a ZMQ endpoint such as tcp://*:5557")
        want("replay_endpoint", self.replay_endpoint is None or (
            isinstance(self.replay_endpoint, str) and "://" in self.replay_endpoint),
            "null or a ZMQ endpoint such as tcp://*:5558")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            want(name, isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 "a positive integer")
        want("topic", isinstance(self.topic, str), "a string")
        want("event_layout", self.event_layout in LAYOUTS,
             '"map" (vLLM 0.24 and later) or "array" (vLLM up to 0.23)')


# --- the publisher

class ZmqEventPublisher:
    """PUB socket for the batches, optional ROUTER socket for replays, one thread.
    Sockets are bound (or connected) here, so a bad endpoint fails at start-up; after
    start() only the thread touches them."""

    def __init__(self, cfg: KVEventsConfig, block_size: int, model_name: str = "") -> None:
        self.block_size = block_size
        self.layout = cfg.event_layout
        self._topic = cfg.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)  # (seq, payload)
        self._seq = itertools.count()
        self._published = KV_EVENTS_PUBLISHED.labels(model_name)
        self._dropped = KV_EVENTS_DROPPED.labels(model_name)
        self.num_published = self.num_dropped = 0  # events
        self._num_dropped_batches = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        try:
            self.endpoint = _bind_or_connect(self._pub, cfg.endpoint)
            self.replay_endpoint = None
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
                self.replay_endpoint = _last_endpoint(self._replay)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"--kv-events-config: cannot open endpoint {cfg.endpoint!r} "
                              f"(replay {cfg.replay_endpoint!r}): {e}") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> ZmqEventPublisher:
        self._thread.start()
        log.info("kv_events_publishing", endpoint=self.endpoint,
                 replay_endpoint=self.replay_endpoint, block_size=self.block_size,
                 event_layout=self.layout)
        return self

    def publish(self, events: list) -> None:
        """Called by the engine loop with what the core recorded: never blocks."""
        if not events:
            return
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped += len(events)
            self._dropped.inc(len(events))
            self._num_dropped_batches += 1
            if self._num_dropped_batches % 1000 == 1:  # the first, then sparsely
                log.warning("kv_events_dropped", seq=seq, events=len(events),
                            dropped_total=self.num_dropped, queue_size=self._queue.maxsize)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._close_sockets()

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        batch_struct = _STRUCTS[self.layout][3]
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                seq, ts, events = self._queue.get(timeout=0.05)  # also the replay poll period
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                batch = batch_struct(
                    ts=ts, events=[to_wire(e, self.block_size, self.layout) for e in events],
                    data_parallel_rank=0)
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception as e:  # noqa: BLE001 - never take the scheduler down
                log.error("kv_events_send_failed", seq=seq, error=str(e))
                continue
            self._buffer.append((seq, payload))
            self.num_published += len(events)
            self._published.inc(len(events))

    def _serve_replay(self) -> None:
        """A request is (identity, b"", start seq as 8 bytes big-endian); the answer is
        every kept batch from there as (identity, b"", seq, payload), then seq -1."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc:// or inproc:// endpoint, connect any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind_or_connect(sock: zmq.Socket, endpoint: str) -> str:
    if _binds(endpoint):
        sock.bind(endpoint)
        return _last_endpoint(sock)
    sock.connect(endpoint)
    return endpoint


def _last_endpoint(sock: zmq.Socket) -> str:
    # "tcp://127.0.0.1:*" binds a free port; this names the one taken
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def start_publisher(cfg: KVEventsConfig, kv_cache_manager, block_size: int,
                    model_name: str) -> ZmqEventPublisher | None:
    """The publisher for --kv-events-config (None when off), with the core recording."""
    if not cfg.enabled:
        return None
    publisher = ZmqEventPublisher(cfg, block_size, model_name)
    kv_cache_manager.record_events()
    return publisher.start()
