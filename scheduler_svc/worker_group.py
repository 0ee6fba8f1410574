"""The client side of the Worker API: one Step stream per tensor-parallel rank.
Every rank gets the same step; rank 0 answers with the tokens.

--worker-addresses may list spare groups after the active one (`a0,a1;s0,s1`).
When the active group is lost, reconnect() tries it first (a restarted container
comes back on its address), then the spares in order, round robin; the first
group that answers and matches what the scheduler was built for becomes active
(docs/resilience.md).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from scheduler_svc.core.config import ConfigError
from scheduler_svc.engine_errors import WorkerDisagreement, WorkerLost
from shared.wire.common import model_info_from_proto
from shared.wire.worker import runner_output_from_proto, scheduler_output_to_proto
from shared.arg_types import WorkerGroups, worker_groups
from shared.grpc_server import CHANNEL_OPTIONS
from shared.instance import SCHEDULER_HEADER, new_scheduler_id
from shared.link_security import LinkSecurity
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.telemetry import context_carrier, get_logger
from shared.types import ModelInfo, ModelRunnerOutput, SchedulerOutput

log = get_logger(service="scheduler")

# what a group that replaces a lost one must share with it: the core was built on it
_SAME = ("model_name", "num_kv_blocks", "block_size", "vocab_size", "max_num_batched_tokens",
         "speculative_config")
# what a group coming back after a loss must still share with the lost one: all of it
# but the KV pool's size, which a worker sizes from the memory free at its start
# (the scheduler adopts another size: Scheduler.resize_kv_pool, docs/resilience.md)
_SAME_AFTER_LOSS = tuple(f for f in _SAME if f != "num_kv_blocks")


class WorkerGroup:
    def __init__(self, addresses: Sequence[str] | WorkerGroups,
                 step_timeout_s: float | None = None,
                 security: LinkSecurity | None = None) -> None:
        self.groups = worker_groups(addresses)  # the active one and the spares, in order
        self.active = 0  # index into groups
        self.num_failovers = 0
        self.step_timeout_s = step_timeout_s  # None: wait for a step's answer forever
        self._security = security or LinkSecurity()  # TLS and the workers' internal token
        # this scheduler on its Step streams: a worker hands itself over at once to the
        # same scheduler reconnecting, while its old stream is still closing there
        self.scheduler_id = new_scheduler_id()
        self._stubs: dict[int, list] = {}  # group -> a stub per rank, made on first use
        self._channels: list[grpc.Channel] = []
        self._outboxes: list[queue.SimpleQueue] = []
        self._closing = False
        self._replies: list = []
        self._answers: list[queue.SimpleQueue] = []  # per rank: replies, then a WorkerLost
        self._accepted: list[queue.SimpleQueue] = []  # per rank: True, or why not (WorkerLost)
        self.generation = 0  # one per set of open streams; a lost signal names its own
        self.model_info: ModelInfo | None = None
        self._on_lost = None

    @property
    def addresses(self) -> list[str]:
        """The active group's addresses, in rank order."""
        return self.groups[self.active]

    def _group_stubs(self, index: int) -> list:
        if index not in self._stubs:
            channels = [self._security.channel(a, CHANNEL_OPTIONS) for a in self.groups[index]]
            self._channels += channels
            self._stubs[index] = [worker_pb2_grpc.WorkerStub(c) for c in channels]
        return self._stubs[index]

    def handshake(self, timeout_s: float, max_num_batched_tokens: int | None = None) -> ModelInfo:
        """Wait for every rank of the active group (they may still be loading the
        model) and check that they form one group that agrees on the step token
        budget (None: adopt the workers'); returns rank 0's model facts."""
        self.model_info = self._handshake_group(self.active, timeout_s, max_num_batched_tokens)
        return self.model_info

    def _handshake_group(self, index: int, timeout_s: float,
                         max_num_batched_tokens: int | None) -> ModelInfo:
        addresses = self.groups[index]
        tp = len(addresses)
        infos = []
        ask = worker_pb2.HandshakeRequest(tensor_parallel_size=tp,
                                          max_num_batched_tokens=max_num_batched_tokens or 0)
        for rank, (address, stub) in enumerate(zip(addresses, self._group_stubs(index))):
            reply = stub.Handshake(ask, timeout=timeout_s, wait_for_ready=True,
                                   metadata=self._security.metadata)
            if reply.rank != rank or reply.tensor_parallel_size != tp:
                raise ConfigError(
                    f"worker {address} is rank {reply.rank} of {reply.tensor_parallel_size}, "
                    f"but --worker-addresses lists it as rank {rank} of {tp}")
            infos.append(model_info_from_proto(reply.model_info))
        for address, info in zip(addresses[1:], infos[1:]):
            if any(getattr(info, f) != getattr(infos[0], f) for f in _SAME):
                raise ConfigError(f"worker {address} reports {info}, rank 0 {infos[0]}")
        return infos[0]

    def open_streams(self, on_lost=None) -> None:
        """Open one Step stream per rank of the active group; on_lost(generation,
        error) is called if one ends while the group is open (a worker died), even
        when no step is in flight."""
        self._on_lost = on_lost if on_lost is not None else self._on_lost
        self.generation += 1
        self._outboxes, self._replies, self._answers, self._accepted = [], [], [], []
        for address, stub in zip(self.addresses, self._group_stubs(self.active)):
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            answers: queue.SimpleQueue = queue.SimpleQueue()
            accepted: queue.SimpleQueue = queue.SimpleQueue()
            self._outboxes.append(outbox)
            self._answers.append(answers)
            self._accepted.append(accepted)
            replies = stub.Step(iter(outbox.get, None), metadata=(
                *self._security.metadata, (SCHEDULER_HEADER, self.scheduler_id)))
            self._replies.append(replies)
            threading.Thread(target=self._read,
                             args=(address, replies, answers, self.generation, accepted),
                             name=f"step-replies-{address}", daemon=True).start()

    def _await_accepted(self, timeout_s: float) -> str | None:
        """None once every rank took its Step stream (a worker sends its headers then);
        otherwise why not: a worker still held by another (e.g. a dead) scheduler's
        stream refuses it, and that is no reconnect yet."""
        for address, accepted in zip(self.addresses, self._accepted):
            try:
                item = accepted.get(timeout=timeout_s)
            except queue.Empty:
                return f"worker {address} did not take the Step stream within {timeout_s:g} s"
            if item is not True:
                return str(item)
        return None

    def _read(self, address: str, replies, answers: queue.SimpleQueue, generation: int,
              accepted: queue.SimpleQueue | None = None) -> None:
        # A reader per rank, so collect() can give up after --step-timeout-s.
        try:
            replies.initial_metadata()  # the worker's headers: it took the stream, or it ended
            if accepted is not None and not replies.done():
                accepted.put(True)
            for reply in replies:
                answers.put(reply)
            error = WorkerLost(f"worker {address} closed its Step stream")
        except grpc.RpcError as e:
            error = WorkerLost(f"the Step stream to worker {address} ended: "
                               f"{e.code().name}: {e.details()}")
        answers.put(error)
        if accepted is not None:
            accepted.put(error)  # after True this is never read
        if not self._closing and generation == self.generation and self._on_lost is not None:
            self._on_lost(generation, error)

    def reconnect(self, timeout_s: float,
                  accept: Callable[[ModelInfo], str | None] | None = None) -> ModelInfo:
        """Drop the current streams and connect afresh: the active group first (a
        restarted worker comes back on its address), then each spare once, in order.
        A group must be the same model, block size, vocabulary, step budget and
        speculation the scheduler was built for (another would break the core); what
        may differ (the KV pool's size, max_model_len) it may take if accept(info)
        gives no reason against it (None: they must be the same too). A dead
        group costs about timeout_s: its first rank that does not answer ends its try.
        Raises WorkerLost if none answered; the caller backs off and calls again."""
        self._end_streams()
        tried = []
        for index in [(self.active + i) % len(self.groups) for i in range(len(self.groups))]:
            try:
                info = self._check_group(index, timeout_s, accept)
            except grpc.RpcError as e:  # not up (yet): a dead address, a loading worker
                tried.append(f"{self._name(index)}: {e.code().name}: {e.details()}")
            except ConfigError as e:  # up, but it cannot take over
                tried.append(f"{self._name(index)}: {e}")
                log.warning("worker_group_skipped", addresses=self.groups[index], reason=str(e))
            else:
                before, self.active = self.active, index  # open this group's streams
                self.open_streams()
                refused = self._await_accepted(timeout_s)
                self.active = before
                if refused is not None:  # alive, but not ours yet: try the next, back off
                    self._end_streams()
                    tried.append(f"{self._name(index)}: {refused}")
                    continue
                self._activate(index, tried)
                self.model_info = info
                return info
        raise WorkerLost("no worker group answered: " + "; ".join(tried))

    def _check_group(self, index: int, timeout_s: float,
                     accept: Callable[[ModelInfo], str | None] | None) -> ModelInfo:
        old = self.model_info
        try:
            info = self._handshake_group(index, timeout_s,
                                         old.max_num_batched_tokens if old else None)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            raise ConfigError(e.details()) from None  # e.g. sized for another step budget
        if old is not None and any(getattr(info, f) != getattr(old, f) for f in _SAME_AFTER_LOSS):
            raise ConfigError(f"not the workers that were lost: they report {info}, the "
                              f"scheduler was built for {old}")
        if old is None:
            return info
        if accept is None and info.num_kv_blocks != old.num_kv_blocks:
            raise ConfigError(f"a KV pool of {info.num_kv_blocks} blocks, the lost workers "
                              f"had {old.num_kv_blocks}")
        if accept is not None and (why := accept(info)) is not None:
            raise ConfigError(why)
        return info

    def _activate(self, index: int, tried: list[str]) -> None:
        if index != self.active:
            log.warning("worker_failover", from_addresses=self.addresses,
                        to_addresses=self.groups[index], failed=tried)
            self.active = index
            self.num_failovers += 1

    def _name(self, index: int) -> str:
        return f"worker group {','.join(self.groups[index])}"

    def _end_streams(self) -> None:
        for outbox in self._outboxes:
            outbox.put(None)
        for replies in self._replies:
            replies.cancel()

    def submit(self, step: SchedulerOutput) -> None:
        msg = scheduler_output_to_proto(step)
        msg.trace_context.update(context_carrier())
        for outbox in self._outboxes:
            outbox.put(msg)

    def collect(self) -> ModelRunnerOutput:
        """The oldest step's answer from every rank; WorkerLost if a stream ended or
        an answer did not come within the step timeout (a hung or stopped worker)."""
        deadline = None if self.step_timeout_s is None else time.monotonic() + self.step_timeout_s
        answers = []
        for address, box in zip(self.addresses, self._answers):
            try:
                item = box.get(timeout=None if deadline is None
                               else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise WorkerLost(f"worker {address} did not answer a step within "
                                 f"--step-timeout-s {self.step_timeout_s:g} s") from None
            if isinstance(item, WorkerLost):
                box.put(item)  # every later collect of this generation fails too
                raise item
            answers.append(item)
        if len({a.step_id for a in answers}) != 1:
            raise WorkerDisagreement(f"ranks answered different steps: "
                                     f"{[a.step_id for a in answers]}")
        failed = [(rank, a) for rank, a in enumerate(answers) if a.error]
        if failed:  # any rank's failure fails the step; a rank that raised, not one that skipped
            rank, a = next(((r, a) for r, a in failed if not a.step_skipped), failed[0])
            where = f"rank {rank}: " if len(answers) > 1 else ""
            return ModelRunnerOutput(step_id=a.step_id, error=where + a.error,
                                     step_skipped=a.step_skipped)
        return runner_output_from_proto(answers[0])

    def close(self) -> None:
        self._closing = True
        self._end_streams()
        for channel in self._channels:
            channel.close()
