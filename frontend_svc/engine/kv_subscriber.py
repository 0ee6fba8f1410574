"""The frontend's subscriber to one replica's KV cache events (docs/kv_events.md):
a ZMQ SUB socket read by an asyncio task on the frontend's loop, so the index it
feeds (frontend_svc/engine/kv_index.py) is only ever touched by that loop.

It decodes vLLM's wire layout (vllm/distributed/kv_events.py, declared once in
shared/kv_event_wire.py for the publisher and this subscriber), current vLLM's maps or
the positional arrays of vLLM up to 0.23, whichever the publisher was set to send, and
keeps the index exact across what goes wrong on the way:
- a gap in the sequence numbers (the publisher dropped batches, or this socket
  joined late) is asked of the replay socket when there is one; a gap replay cannot
  fill means events are lost for good, so the index starts over (`reset`);
- numbers from 0 again: a restarted scheduler, its cache empty: the index is cleared;
- AllBlocksCleared: the workers' KV is gone: cleared.
"""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from shared.kv_event_wire import (ArrayBlockRemoved, ArrayBlockStored, BlockRemoved,
                                  BlockStored, decode_batch)
from shared.telemetry import get_logger

from frontend_svc.engine.kv_index import KvIndex

log = get_logger(component="kv_subscriber")
REPLAY_TIMEOUT_MS = 2000  # per reply of a replay; a silent replay socket is given up
END_SEQ = -1
RESUBSCRIBE_S = 1.0  # after a subscriber socket failed



def apply_batch(index: KvIndex, payload: bytes) -> None:
    """One batch's events, in order, onto the index."""
    for event in decode_batch(payload).events:
        if isinstance(event, (BlockStored, ArrayBlockStored)):
            index.stored(event.block_hashes, event.parent_block_hash, event.token_ids,
                         event.block_size)
        elif isinstance(event, (BlockRemoved, ArrayBlockRemoved)):
            index.removed(event.block_hashes)
        else:
            index.cleared()


def feed(index: KvIndex, seq: int, payload: bytes,
         replayed: list[tuple[int, bytes]] | None = None) -> str:
    """Apply one received batch after what a replay returned for the gap before it
    (replayed: None when there was no gap, or no replay to ask). Returns what
    happened: "applied", "repeat", "restart" or "reset" (a gap nothing filled)."""
    state = index.accept_seq(seq)
    if state == "repeat":
        return state
    if state == "restart":
        index.cleared()
        index.last_seq = None
    elif state == "gap":
        for rseq, rpayload in replayed or ():
            if index.accept_seq(rseq) == "next" and rseq < seq:
                apply_batch(index, rpayload)
                index.last_seq = rseq
        if index.accept_seq(seq) != "next":  # still a hole: those events are gone
            index.cleared()
            state = "reset"
    apply_batch(index, payload)
    index.last_seq = seq
    return "applied" if state in ("next", "gap") else state


class KvSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None, index: KvIndex,
                 topic: str = "", name: str = "") -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.index = index
        self.topic = topic.encode()
        self.name = name
        self.num_batches = 0
        self.num_resets = 0  # gaps replay could not fill
        self._ctx = zmq.asyncio.Context.instance()

    def forget(self) -> None:
        """The replica's scheduler is gone: its cache with it; the next one counts anew."""
        self.index.cleared()
        self.index.last_seq = None

    async def run(self) -> None:
        """Subscribe until cancelled; a socket that fails is opened again (the index
        starts over: what happened meanwhile is unknown)."""
        while True:
            try:
                await self._subscribe()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - routing goes on by load meanwhile
                log.error("kv_events_subscriber_failed", replica=self.name, error=repr(e))
                self.forget()
                await asyncio.sleep(RESUBSCRIBE_S)

    async def _subscribe(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)  # ZMQ reconnects by itself to a restarted publisher
        log.info("kv_events_subscribed", replica=self.name, endpoint=self.endpoint,
                 replay_endpoint=self.replay_endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("kv_events_bad_message", replica=self.name, frames=len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big")
                self._receive(seq, frames[2], await self._replay_if_gap(seq))
        finally:
            sub.close(linger=0)

    def _receive(self, seq: int, payload: bytes, replayed) -> None:
        try:
            state = feed(self.index, seq, payload, replayed)
        except msgspec.DecodeError as e:
            log.warning("kv_events_undecodable", replica=self.name, seq=seq, error=str(e))
            return
        self.num_batches += 1
        if state == "reset":
            self.num_resets += 1
            log.warning("kv_events_gap_unfilled", replica=self.name, seq=seq,
                        replay=self.replay_endpoint is not None)
        elif state == "restart":
            log.info("kv_events_publisher_restarted", replica=self.name)

    async def _replay_if_gap(self, seq: int) -> list[tuple[int, bytes]] | None:
        if self.replay_endpoint is None or self.index.accept_seq(seq) != "gap":
            return None
        start = 0 if self.index.last_seq is None else self.index.last_seq + 1
        try:
            return await self._replay(start)
        except (zmq.ZMQError, asyncio.TimeoutError) as e:
            log.warning("kv_events_replay_failed", replica=self.name, start=start, error=str(e))
            return None

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """Ask the publisher's ROUTER for every kept batch from `start`."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            out = []
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(),
                                                REPLAY_TIMEOUT_MS / 1000)
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return out
                out.append((seq, frames[-1]))
        finally:
            sock.close(linger=0)
