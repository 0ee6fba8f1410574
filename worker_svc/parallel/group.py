"""The torch.distributed group the tensor-parallel ranks of one worker run in: gloo on
CPU, NCCL on CUDA, rendezvous through a TCPStore that rank 0 hosts at
--master-addr:--master-port (MASTER_ADDR / MASTER_PORT accepted, like torchrun).

A group is fail-stop. Every collective runs on the compute thread; one that fails or
outlasts --distributed-timeout raises GroupLost. A heartbeat thread notices a dead
or hung peer even while no step runs (a collective only notices during a step).
Either way on_lost fires once, and the worker exits non-zero: its Step stream ends,
the scheduler treats the group like a lost worker, and restarted ranks form a new
group through a fresh rendezvous (a broken gloo/NCCL communicator cannot be healed
in place, and a half-alive group would compute with a stale peer).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from prometheus_client import Counter

from shared.telemetry import get_logger
from worker_svc.parallel import GroupLost
from worker_svc.parallel.shard import ShardPlan, even_split

log = get_logger(service="worker")


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()

RENDEZVOUS_TIMEOUT_S = 900.0  # ranks start (and load) at their own pace
HEARTBEAT_INTERVAL_S = 1.0

# time inside collectives, waiting for the slowest rank included: the price of the split
COLLECTIVE_TIME = Counter("gapserve:worker_tp_collective_seconds",
                          "Seconds this rank spent in tensor-parallel collectives.",
                          ["rank", "op"])


class TensorParallelGroup:
    def __init__(self, plan: ShardPlan, master_addr: str, master_port: int,
                 timeout_s: float, device: torch.device, backend: str = "auto") -> None:
        self.plan, self.rank, self.size = plan, plan.rank, plan.size
        self.device = device
        self.timeout_s = timeout_s
        self.backend = backend if backend != "auto" else (
            "nccl" if device.type == "cuda" else "gloo")
        self.on_lost: Callable[[str], None] | None = None
        self._lost = threading.Event()
        self._address = (master_addr, master_port)
        self._timers = {op: COLLECTIVE_TIME.labels(str(self.rank), op)
                        for op in ("all_reduce", "gather", "broadcast")}
        t0 = time.perf_counter()
        log.info("tp_rendezvous", rank=self.rank, size=self.size, backend=self.backend,
                 master=f"{master_addr}:{master_port}")
        # rank 0 hosts the store; it waits here until every rank has connected
        self._store = dist.TCPStore(master_addr, master_port, world_size=self.size,
                                    is_master=self.rank == 0,
                                    timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                                    wait_for_workers=True)
        kwargs = {"device_id": device} if self.backend == "nccl" else {}
        dist.init_process_group(self.backend, store=self._store, rank=self.rank,
                                world_size=self.size, timeout=timedelta(seconds=timeout_s),
                                **kwargs)
        self.barrier()
        log.info("tp_group_formed", rank=self.rank, size=self.size, backend=self.backend,
                 seconds=round(time.perf_counter() - t0, 3))
        self._closing = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True)
        self._beat.start()

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (the row-parallel projections' partial sums)."""
        self._run(dist.all_reduce, t)
        return t

    def gather_to_first(self, t: torch.Tensor, full: int) -> torch.Tensor | None:
        """Rank 0 gets the ranks' [rows, part] column slices side by side, cut to `full`
        columns; other ranks get None. Slices are padded to one width (gather needs
        equal shapes; even_split makes them differ by at most one column)."""
        width = -(-full // self.size)
        if t.shape[1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[1]))
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        self._run(dist.gather, t, parts, dst=0)
        if parts is None:
            return None
        return torch.cat([p[:, :b - a] for p, (a, b) in
                          zip(parts, (even_split(full, self.size, r) for r in range(self.size)))],
                         dim=1)

    def broadcast_from_first(self, t: torch.Tensor) -> torch.Tensor:
        self._run(dist.broadcast, t, src=0)
        return t

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        self._run(dist.all_reduce, t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def wait_for_all(self, stage: str) -> None:
        """Wait (up to the rendezvous timeout, not the collective one) until every rank
        has reached `stage`: ranks load their shards at their own pace, and a
        collective would time out on a rank that is still loading."""
        self._store.set(f"{stage}/{self.rank}", "1")
        try:
            self._store.wait([f"{stage}/{r}" for r in range(self.size)],
                             timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 - a timeout or a store that went away
            self.lose(f"not every rank reached {stage}: {e}")
            raise GroupLost(f"not every rank reached {stage}: {e}") from e

    def ranks_on_this_host(self) -> int:
        """How many ranks of the group run on this host (the same kernel boot id, which
        containers share): they split its cores (compute_plan.py)."""
        me = _host_id()
        self._store.set(f"host/{self.rank}", me)
        return sum(self._store.get(f"host/{r}").decode() == me for r in range(self.size))

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def _run(self, fn, /, *args, **kwargs) -> None:
        if self._lost.is_set():
            raise GroupLost("the tensor-parallel group is already lost")
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)
            self._timers[fn.__name__].inc(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            self.lose(f"{fn.__name__} failed on rank {self.rank}: {e}")
            raise GroupLost(f"tensor-parallel {fn.__name__} failed: {e}") from e

    def close(self) -> None:
        """Leave the group at the end of a run: the heartbeat stops and is joined before
        the process group goes, so no store call is in flight while the interpreter
        exits (C++ would abort the process: 'terminate called without an active
        exception', a helper rank's exit code -6)."""
        self._closing.set()
        self._beat.join(timeout=HEARTBEAT_INTERVAL_S + self.timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ liveness

    def lose(self, reason: str) -> None:
        if self._lost.is_set():
            return
        self._lost.set()
        log.error("tp_group_lost", rank=self.rank, size=self.size, reason=reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def _heartbeat(self) -> None:
        """Beat a counter in the store each second and watch the peers' counters:
        one that stands still for the timeout, or a store that stops answering
        (rank 0, its host, died), loses the group."""
        try:  # its own connection: the process group's store is not shared across threads
            store = dist.TCPStore(*self._address, is_master=False,
                                  timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001
            self.lose(f"cannot reach the rendezvous store: {e}")
            return
        peers = [r for r in range(self.size) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in peers}
        while not self._lost.wait(HEARTBEAT_INTERVAL_S) and not self._closing.is_set():
            try:
                store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                for r in peers:
                    count = store.add(f"beat/{r}", 0)
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.timeout_s:
                        self.lose(f"rank {r} sent no heartbeat for {self.timeout_s:.0f} s")
                        return
            except Exception as e:  # noqa: BLE001 - the store's host is gone
                self.lose(f"the rendezvous store stopped answering: {e}")
                return
