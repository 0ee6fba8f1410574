"""Readiness that tells the truth (docs/resilience.md): the frontend is ready only
while its scheduler session is open AND the scheduler reports SERVING on
grpc.health.v1, which it does only while it holds its workers. This follows the
scheduler's health with a Watch stream, so a lost worker shows at the frontend's
/ready and gRPC health at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.telemetry import get_logger

log = get_logger(component="readiness")
SCHEDULER_SERVICE = "gapserve.v1.Engine"
RETRY_S = 0.5  # between Watch attempts while the scheduler is away


class SchedulerHealth:
    def __init__(self, channel: grpc.aio.Channel,
                 on_change: Callable[[], Awaitable[None]]) -> None:
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._on_change = on_change
        self.serving = False

    async def _set(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            log.info("scheduler health", serving=serving)
            await self._on_change()

    async def run(self) -> None:
        request = health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE)
        while True:
            try:
                async for reply in self._stub.Watch(request, wait_for_ready=True):
                    await self._set(reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError:
                pass  # the scheduler went away; watch again when it is back
            await self._set(False)
            await asyncio.sleep(RETRY_S)
