"""What the engine loop does when its workers are lost (docs/resilience.md).

A step not answered within --step-timeout-s, a Step stream that ended, or answers
the core cannot apply (a worker fault) all mean the workers lost every request's KV:
the core requeues them all by recomputation (prompt and tokens so far are kept in
the scheduler), the KV pool starts empty, and the loop reconnects to the active
group, then to each spare, backing off (scheduler_svc/backoff.py) while it applies
the inbox meanwhile (adds queue, aborts end). Workers back with another KV pool size
or max_model_len are taken if they can hold what the scheduler admits. Health says
NOT_SERVING while no worker group is connected.

Engine (scheduler_svc/engine.py) runs these on its loop thread; they read and write
its state as its own methods do.
"""

from __future__ import annotations

import structlog

from scheduler_svc.backoff import BurstLog
from scheduler_svc.core.scheduler import pool_refusal
from scheduler_svc.engine_errors import WorkerDisagreement, WorkerLost
from shared.types import ModelInfo

log = structlog.get_logger("scheduler.engine")


class WorkerLossRecovery:
    """Engine's worker-loss methods (a mixin: Engine holds the state they use)."""


    def _recover(self, error: WorkerLost) -> bool:
        """The workers lost every request: requeue them all by recompute (prompt and
        tokens so far are kept here) and reconnect with backoff, applying the inbox
        meanwhile (adds queue, aborts end). False if told to stop first."""
        tel = self._tel
        if isinstance(error, WorkerDisagreement):  # a worker fault the loss log understates
            self.num_worker_disagreements += 1
            log.error("worker_disagreement", error=str(error), req_ids=sorted(error.sides),
                      sides=error.sides)
            if tel is not None:
                tel.worker_disagreement()
        looping = not self._progress  # lost again before a step was applied
        if (n := self._lost_log.event()) is not None:  # once per burst of losses
            log.warning("worker_lost", error=str(error), in_flight_steps=len(self._in_flight),
                        losses_in_burst=n)
        self._set_workers_connected(False)
        self._in_flight.clear()  # their results will never come; telemetry drops them below
        recovered, failed = self._scheduler.worker_lost(str(error))
        self._publish_kv_events()  # AllBlocksCleared: the workers' KV is gone
        self.num_requests_recovered += len(recovered)
        if tel is not None:
            tel.worker_lost(len(recovered))
        self._fail_requests(failed, "worker_lost")
        if tel is not None:
            tel.refresh(self._scheduler.stats())
        rounds = BurstLog()  # failed reconnect rounds of this loss
        wait = self._backoff.next() if looping else 0.0
        while True:
            if wait:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping, timeout=wait)
            with self._cond:
                if self._stopping:
                    return False
                commands = [c for c in self._inbox if c[0] not in ("lost", "fail")]
                self._inbox.clear()
            self._apply(commands)
            try:
                info = self._executor.reconnect(self._reconnect_timeout_s,
                                                accept=self._refusal_after_loss)
                break
            except WorkerLost as e:
                wait = self._backoff.next()
                self.num_reconnect_failures += 1
                if tel is not None:
                    tel.worker_reconnect_failed()
                if (n := rounds.event()) is not None:
                    log.warning("worker_reconnect_failed", error=str(e), retry_in_s=wait,
                                failed_rounds=n)
        self.num_worker_reconnects += 1
        self._adopt_pool(info)
        before, self.worker_addresses = self.worker_addresses, list(
            getattr(self._executor, "addresses", []))
        failover = self.worker_addresses != before  # a spare took over
        self.num_worker_failovers += failover
        if tel is not None:
            tel.worker_reconnected(failover)
            if failover:
                tel.worker_group_active(self.worker_addresses)
        self._progress = False
        log.info("worker_reconnected", requests_recovered=len(recovered),
                 waiting=len(self._scheduler.waiting), addresses=self.worker_addresses,
                 failover=failover, failed_rounds=rounds.end(),
                 isolating=[r.req_id for r in self._scheduler.failures.suspects])
        self._set_workers_connected(True)
        return True

    def _refusal_after_loss(self, info: ModelInfo) -> str | None:
        """Why workers back after a loss cannot take over what they lost, or None: they
        must take every length this scheduler admits, and their KV pool, whatever its
        size, the longest request (Scheduler.resize_kv_pool adopts it)."""
        cfg = self._scheduler.config
        if info.max_model_len < cfg.max_model_len:
            return (f"their max_model_len {info.max_model_len} is below the scheduler's "
                    f"{cfg.max_model_len}")
        refusal = pool_refusal(cfg, info.num_kv_blocks)
        return None if refusal is None else f"their KV pool: {refusal}"

    def _adopt_pool(self, info: ModelInfo) -> None:
        """Workers back with a KV pool of another size (sized from the memory free at
        their start): the scheduler's pool, emptied by the loss, takes that size."""
        before = self.model_info.num_kv_blocks
        if info.num_kv_blocks != before:
            self._scheduler.resize_kv_pool(info.num_kv_blocks)
            log.warning("kv_pool_resized", num_kv_blocks=info.num_kv_blocks,
                        was=before, waiting=len(self._scheduler.waiting))
            if self._tel is not None:
                self._tel.refresh(self._scheduler.stats())
        self.model_info = info

    def _set_workers_connected(self, connected: bool) -> None:
        self.workers_connected = connected
        if self._on_serving is not None:
            self._on_serving(connected)
