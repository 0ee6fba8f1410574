"""Which `gapserve serve` started a service. serve draws an id per start and gives it
to its children (--instance-id); each reports it, in grpc.health.v1 as the service name
below and on the frontend's /health as a header, so serve's probes accept only its own
children and never another server that answers on the same ports."""

from __future__ import annotations

import uuid

HEADER = "x-gapserve-instance"  # on /health; the status code and body keep their contract


def new_instance_id() -> str:
    return uuid.uuid4().hex[:16]


def health_service(instance_id: str) -> str:
    """The grpc.health.v1 service name that answers SERVING exactly when the whole
    service does; any other server answers NOT_FOUND for it."""
    return f"gapserve.instance.{instance_id}"


# Which scheduler drives a worker: the scheduler's WorkerGroup draws an id per process
# and sends it on every Step stream, so a worker tells the same scheduler reconnecting
# (its old stream not yet closed here) from another scheduler (worker_svc/server.py).
SCHEDULER_HEADER = "x-gapserve-scheduler"


def new_scheduler_id() -> str:
    return uuid.uuid4().hex[:16]
