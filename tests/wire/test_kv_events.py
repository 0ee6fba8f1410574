"""KV cache events on a real ZMQ socket, decoded with vLLM's own struct layout
(vllm/distributed/kv_events.py of vLLM 0.33.0, the current release, written out here
as vLLM declares it, not imported from our wire module), from a real scheduler on the
tiny model: what a prefix-aware router subscribed to gapserve sees. The older layout
(`"event_layout": "array"`) is decoded with vLLM 0.23.0's declarations."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from scheduler_svc.core.block_pool import BlocksRemoved, BlocksStored, CacheCleared
from scheduler_svc.core.config import ConfigError
from scheduler_svc.kv_events import KVEventsConfig, ZmqEventPublisher, start_publisher
from shared import config as flags
from tests.wire.conftest import start_wire_stack
from tests.wire.session_client import SessionClient

TIMEOUT_MS = 10_000  # a bound on waiting for a message, never a pause


# --- vLLM 0.33.0's structs: the batch an array, each event a map tagged "type"
# (ExternalBlockHash is `bytes | int` there)

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# strict: a field of ours that vLLM 0.33.0 does not declare fails the decode
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


# --- vLLM 0.23.0's: the events positional arrays too, the class name first

class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                      tag=True):
    pass


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(EventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


def low64(digest: bytes) -> int:  # vLLM's maybe_convert_block_hash, int mode (its default)
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def subscribe(endpoint: str, topic: bytes = b"") -> zmq.Socket:
    """A SUB socket whose handshake with the publisher is done (no slow-joiner loss)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    assert monitor.poll(TIMEOUT_MS), "the subscriber never connected"
    monitor.recv_multipart()
    sub.disable_monitor()
    monitor.close(linger=0)
    return sub


def subscribe_ready(publisher, topic: bytes = b"", first: int = 0) -> tuple[zmq.Socket, int]:
    """ZMQ's cure for the slow joiner: publish probes (AllBlocksCleared, numbered from
    `first`) until one arrives, then drain them. Returns the socket and the next
    batch's sequence number."""
    sub = subscribe(publisher.endpoint, topic)
    probes = 0
    while True:
        publisher.publish([CacheCleared()])
        probes += 1
        if sub.poll(100):  # a bounded wait per probe; the loop ends on the first arrival
            break
        assert probes < 100, "the subscription never took effect"
    while receive_raw(sub)[1] != first + probes - 1:
        pass
    return sub, first + probes


def receive_until(sub: zmq.Socket, last: int) -> list[int]:
    """Sequence numbers received up to `last` (earlier ones may precede the subscription)."""
    seqs = []
    while not seqs or seqs[-1] != last:
        seqs.append(receive(sub)[1])
    return seqs


def receive_raw(sub: zmq.Socket) -> tuple[bytes, int, bytes]:
    assert sub.poll(TIMEOUT_MS), "no KV event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), payload


def receive(sub: zmq.Socket) -> tuple[bytes, int, KVEventBatch]:
    topic, seq, payload = receive_raw(sub)
    return topic, seq, DECODER.decode(payload)


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from a DEALER: (seq, payload) frames, then seq -1."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(TIMEOUT_MS), "the replay did not end"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def local_config(**overrides) -> KVEventsConfig:
    return KVEventsConfig.from_json(msgspec.json.encode({
        "enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*", **overrides}).decode())


@pytest.fixture
def stack_with_events(tiny_runner):
    stack = start_wire_stack(tiny_runner, hash_seed="kv-events-test")
    info = stack.engine.model_info
    publisher = stack.engine.run_on_loop(lambda: start_publisher(
        local_config(topic="kv"), stack.scheduler_core.kv, info.block_size, info.model_name))
    stack.engine.kv_events = publisher
    yield stack, publisher
    stack.close()
    publisher.close()


def test_requests_sharing_a_prefix_publish_its_blocks_once_chained_by_parent_hash(
        stack_with_events):
    stack, publisher = stack_with_events
    size = stack.engine.model_info.block_size
    sub, _ = subscribe_ready(publisher, b"kv")
    client = SessionClient(stack.engine_stub)
    try:
        a = [(7 * i) % 97 + 3 for i in range(2 * size + 5)]  # two full blocks and a tail
        b = a[:2 * size] + [(5 * i) % 89 + 4 for i in range(size + 3)]  # a's two, one more
        client.add("a", a, max_tokens=2, temperature=0.0)
        client.wait_ended("a")
        client.add("b", b, max_tokens=2, temperature=0.0)
        client.wait_ended("b")
        batches = []
        stored = []
        while len(stored) < 2:
            topic, seq, batch = receive(sub)
            assert topic == b"kv" and batch.data_parallel_rank == 0
            batches.append((seq, batch))
            stored += [e for e in batch.events if isinstance(e, BlockStored)]
    finally:
        client.close()
        sub.close(linger=0)
    first, second = stored
    assert first.token_ids == a[:2 * size] and first.parent_block_hash is None
    assert second.token_ids == b[2 * size:3 * size]  # b's hit on a's blocks is not re-sent
    assert second.parent_block_hash == first.block_hashes[1]
    for event in stored:
        assert len(event.block_hashes) * size == len(event.token_ids)
        assert (event.block_size, event.medium, event.lora_id, event.group_idx) == \
            (size, "GPU", None, 0)
    cached = stack.engine.run_on_loop(lambda: list(stack.scheduler_core.kv.pool.cached))
    assert {h for e in stored for h in e.block_hashes} == {low64(h) for h in cached}
    seqs = [seq for seq, _ in batches]
    assert seqs == sorted(set(seqs))  # strictly increasing

    replayed = replay(publisher.replay_endpoint, 0)
    assert [seq for seq, _ in replayed] == list(range(seqs[-1] + 1))
    live = {seq: batch for seq, batch in batches}
    for seq, payload in replayed:
        if seq in live:
            assert DECODER.decode(payload) == live[seq]
    assert [s for s, _ in replay(publisher.replay_endpoint, seqs[-1])] == [seqs[-1]]


def test_every_event_kind_decodes_with_vllms_structs_and_hashes_are_the_low_64_bits():
    publisher = ZmqEventPublisher(local_config(), block_size=4).start()
    sub, next_seq = subscribe_ready(publisher)
    h1, h2 = bytes(range(32)), bytes(range(32, 64))
    try:
        publisher.publish([BlocksStored([h1, h2], None, list(range(8))),
                           BlocksRemoved([h1]), CacheCleared()])
        _, seq, batch = receive(sub)
    finally:
        sub.close(linger=0)
        publisher.close()
    assert seq == next_seq and batch.ts > 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored(block_hashes=[low64(h1), low64(h2)], parent_block_hash=None,
                                 token_ids=list(range(8)), block_size=4, lora_id=None,
                                 medium="GPU", lora_name=None, group_idx=0,
                                 kv_cache_spec_kind="full_attention")
    assert removed == BlockRemoved(block_hashes=[low64(h1)], medium="GPU", group_idx=0)
    assert cleared == AllBlocksCleared()
    assert publisher.num_published == next_seq + 3


def test_the_payload_is_byte_for_byte_what_vllm_0_33_would_encode():
    """Not only decodable: the same bytes vLLM's own structs encode for these values,
    and on the wire a positional 3-array whose events are maps with exactly the
    fields set (defaults omitted, as vLLM's omit_defaults does)."""
    publisher = ZmqEventPublisher(local_config(), block_size=4).start()
    sub, _ = subscribe_ready(publisher)
    h1, h2 = bytes(range(32)), bytes(range(32, 64))
    try:
        publisher.publish([BlocksStored([h2], h1, [9, 8, 7, 6]), BlocksRemoved([h1])])
        assert sub.poll(TIMEOUT_MS)
        _, _, payload = sub.recv_multipart()
    finally:
        sub.close(linger=0)
        publisher.close()
    batch = DECODER.decode(payload)
    expected = KVEventBatch(ts=batch.ts, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[low64(h2)], parent_block_hash=low64(h1),
                    token_ids=[9, 8, 7, 6], block_size=4, lora_id=None, medium="GPU",
                    lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemoved(block_hashes=[low64(h1)], medium="GPU", group_idx=0)])
    assert payload == msgspec.msgpack.encode(expected)
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
    assert [sorted(e) for e in raw[1]] == [
        sorted(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                "lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind"]),
        sorted(["type", "block_hashes", "medium", "group_idx"])]
    assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockRemoved"]


def test_the_array_layout_is_vllm_0_23s_and_the_frontend_reads_both():
    """`"event_layout": "array"`: for routers whose decoders predate vLLM 0.24 (events
    as positional arrays, class name first). Decoded with vLLM 0.23.0's structs; the
    frontend's own subscriber takes either layout."""
    from frontend_svc.engine.kv_index import KvIndex, block_keys
    from frontend_svc.engine.kv_subscriber import apply_batch

    publisher = ZmqEventPublisher(local_config(event_layout="array"), block_size=4).start()
    sub, _ = subscribe_ready(publisher)
    h1, h2 = bytes(range(32)), bytes(range(32, 64))
    try:
        publisher.publish([BlocksStored([h1, h2], None, list(range(8))), BlocksRemoved([h2]),
                           CacheCleared()])
        assert sub.poll(TIMEOUT_MS)
        _, _, payload = sub.recv_multipart()
    finally:
        sub.close(linger=0)
        publisher.close()
    batch = msgspec.msgpack.Decoder(OldKVEventBatch).decode(payload)
    assert batch.events == [
        OldBlockStored(block_hashes=[low64(h1), low64(h2)], parent_block_hash=None,
                       token_ids=list(range(8)), block_size=4, lora_id=None, medium="GPU",
                       lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
        OldBlockRemoved(block_hashes=[low64(h2)], medium="GPU", group_idx=0),
        OldAllBlocksCleared()]
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][:1] == ["BlockStored"] and raw[1][1] == ["BlockRemoved", [low64(h2)],
                                                             "GPU", 0]
    with pytest.raises(msgspec.ValidationError):
        DECODER.decode(payload)  # a current-vLLM decoder cannot read it, and vice versa
    index = KvIndex(4)
    apply_batch(index, msgspec.msgpack.encode(OldKVEventBatch(ts=1.0, events=batch.events[:2])))
    assert index.match(block_keys(list(range(8)), 4), 0.0) == 1  # stored two, removed one
    apply_batch(index, payload)  # the whole batch, as sent: cleared at its end
    assert index.num_blocks == 0 and index.num_resets == 1


def test_a_full_queue_drops_and_counts_and_leaves_a_sequence_gap_subscribers_can_see():
    publisher = ZmqEventPublisher(local_config(max_queue_size=2), block_size=4)
    sub = None
    try:
        for _ in range(3):  # the thread is not started yet: the third does not fit
            publisher.publish([CacheCleared()])
        assert publisher.num_dropped == 1
        # the probes below must not be dropped too when the thread lags on a busy machine
        publisher._queue.maxsize = 0
        publisher.start()
        sub, next_seq = subscribe_ready(publisher, first=3)  # probes numbered 3, 4, ...
        assert [s for s, _ in replay(publisher.replay_endpoint, 0)] == \
            [0, 1, *range(3, next_seq)]
    finally:
        if sub is not None:
            sub.close(linger=0)
        publisher.close()
    assert publisher.num_published == next_seq - 1


def test_the_replay_buffer_keeps_only_the_last_buffer_steps_batches():
    publisher = ZmqEventPublisher(local_config(buffer_steps=2), block_size=4).start()
    sub, next_seq = subscribe_ready(publisher)
    try:
        for _ in range(4):
            publisher.publish([CacheCleared()])
        assert receive_until(sub, next_seq + 3)[-1] == next_seq + 3
        assert [s for s, _ in replay(publisher.replay_endpoint, 0)] == \
            [next_seq + 2, next_seq + 3]
    finally:
        sub.close(linger=0)
        publisher.close()


def test_the_flag_takes_vllms_keys_and_defaults():
    args = flags.parse_args(flags.scheduler_parser(), [], environ={})
    assert args.kv_events_config is None and not KVEventsConfig.from_json(None).enabled
    env = {"GAPSERVE_KV_EVENTS_CONFIG": '{"enable_kv_cache_events": true}'}
    cfg = KVEventsConfig.from_json(
        flags.parse_args(flags.scheduler_parser(), [], environ=env).kv_events_config)
    assert cfg.enabled and cfg.publisher == "zmq"
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.topic, cfg.buffer_steps, cfg.hwm,
            cfg.max_queue_size) == ("tcp://*:5557", None, "", 10_000, 100_000, 100_000)
    assert cfg.event_layout == "map"  # ours: current vLLM's layout unless asked
    off = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not off.enabled


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "port": 1}', "unknown key(s) port"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be a boolean"),
    ('{"publisher": "kafka"}', 'publisher must be "zmq" or "null"'),
    ('{"hwm": 0}', "hwm must be a positive integer"),
    ('{"endpoint": "5557"}', "endpoint must be a ZMQ endpoint"),
    ('{"event_layout": "tuple"}', 'event_layout must be "map"'),
])
def test_a_bad_config_is_refused_with_the_reason(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KVEventsConfig.from_json(text)


def test_an_endpoint_that_cannot_be_opened_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="cannot open endpoint 'ipc:///nonexistent-gapserve"):
        ZmqEventPublisher(local_config(endpoint="ipc:///nonexistent-gapserve-dir/kv",
                                       replay_endpoint=None), block_size=4)
