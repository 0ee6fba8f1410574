"""Container health check: exits 0 when the server answers healthy, 1 otherwise.

    python deploy/healthcheck.py 127.0.0.1:50053 [SERVICE]    # grpc.health.v1 SERVING
    python deploy/healthcheck.py http://127.0.0.1:8000/health # HTTP 2xx

docker-compose.yml runs it in each gapserve container, so `depends_on` with
`condition: service_healthy` (and `up --wait`) waits until a service really answers,
not only until its process exists. The frontend is probed over the HTTP API its users
call. It needs only grpcio and grpcio-health-checking (HTTP: the standard library).
"""

from __future__ import annotations

import ssl
import sys
import urllib.error
import urllib.request

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


def check_http(url: str) -> tuple[bool, str]:
    """(2xx?, what was seen) for one GET. TLS is not verified: the probe runs in the
    server's own container, where only the address matters."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as reply:
            return 200 <= reply.status < 300, f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, str(getattr(exc, "reason", exc))


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or ":" not in argv[1]:
        print("usage: healthcheck.py HOST:PORT [SERVICE] | http(s)://HOST:PORT/PATH",
              file=sys.stderr)
        return 2
    if argv[1].startswith(("http://", "https://")):
        ok, seen = check_http(argv[1])
    else:
        ok, seen = check(argv[1], argv[2] if len(argv) == 3 else "")
    print(f"{argv[1]}: {seen}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
