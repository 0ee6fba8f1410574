"""Container health check over the standard gRPC health protocol (grpc.health.v1):
exits 0 when the server at ADDRESS answers SERVING, 1 otherwise.

    python deploy/healthcheck.py 127.0.0.1:50053 [SERVICE]

docker-compose.yml runs it in each gapserve container, so `depends_on` with
`condition: service_healthy` waits until a service really answers, not only until
its process exists. It needs only grpcio and grpcio-health-checking.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def check(address: str, service: str = "") -> tuple[bool, str]:
    """(serving?, what was seen) for one Check call."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return False, exc.code().name
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or ":" not in argv[1]:
        print("usage: healthcheck.py HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    ok, seen = check(argv[1], argv[2] if len(argv) == 3 else "")
    print(f"{argv[1]}: {seen}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
