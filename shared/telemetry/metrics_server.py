"""The Prometheus /metrics endpoint of the scheduler and the workers (the frontend
serves /metrics on its own HTTP port, from the same default registry)."""

from __future__ import annotations

from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from shared.ports import PortUnavailable, check_free


@dataclass(slots=True)
class MetricsServer:
    server: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_metrics_server(port: int, host: str = "127.0.0.1",
                         flag: str = "--metrics-port") -> MetricsServer:
    """Serve /metrics in a daemon thread; port 0 picks a free one (see .port). A port
    that cannot be bound is PortUnavailable, naming `flag`."""
    if not 0 <= port <= 65535:
        raise ValueError(f"{flag} must be in 0..65535, got {port}")
    check_free(host, port, flag)
    try:
        server, thread = start_http_server(port, addr=host)
    except OSError as e:  # taken between the check and the bind
        raise PortUnavailable(host, port, flag, e) from None
    return MetricsServer(server, thread)


def metrics_text() -> tuple[bytes, str]:
    """The body and content type of a /metrics response (for the frontend's app)."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
