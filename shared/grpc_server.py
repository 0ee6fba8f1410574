"""What every gRPC service of ours has: a server with generous message limits,
the standard grpc.health.v1 service and server reflection."""

from __future__ import annotations

import errno
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.instance import health_service
from shared.link_security import LinkSecurity
from shared.ports import PortUnavailable, check_free

# Prompts of a long context and a step of many requests can pass 4 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# What a stream coalesces into one message when items queued up behind a slow
# reader or writer (frontend <-> scheduler Session): big enough that a backlog
# drains in a few messages, small enough that handling one keeps an event loop
# busy for at most tens of milliseconds.
COALESCE_BYTES = 256 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# gRPC binds with SO_REUSEPORT by default: a second server would share the port
# silently and take half the connections. Ours own their ports (shared/ports.py).
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


class ServiceServer:
    """A grpc.Server plus its health servicer; services start NOT_SERVING and
    turn SERVING with set_serving() once they can answer."""

    def __init__(self, max_workers: int = 32, security: LinkSecurity | None = None,
                 instance_id: str | None = None) -> None:
        self.security = security or LinkSecurity()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                                  options=SERVER_OPTIONS,
                                  interceptors=self.security.interceptors())
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # `gapserve serve` asks for this name: only its own child knows it
        self._names: list[str] = [health_service(instance_id)] if instance_id else []
        self.port = 0

    def add(self, add_fn, servicer, full_name: str) -> None:
        """Register a servicer, e.g. add(add_WorkerServicer_to_server, s, "gapserve.v1.Worker")."""
        add_fn(servicer, self.server)
        self._names.append(full_name)
        self.health.set(full_name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def start(self, host: str, port: int, flag: str = "--port") -> int:
        """Listen on host:port (exclusively); PortUnavailable names the port and
        `flag`, the option that moves it."""
        names = [*self._names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = add_port(self.server, self.security, host, port, flag)
        self.server.start()
        return self.port

    def set_serving(self, serving: bool = True) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self._names]:
            self.health.set(name, status)

    def stop(self, grace_s: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()


def add_port(server, security: LinkSecurity, host: str, port: int, flag: str) -> int:
    """security.add_port for a sync or asyncio server, checked first so that a busy
    port is PortUnavailable (one line) rather than gRPC's error log and RuntimeError."""
    check_free(host, port, flag)
    try:
        bound = security.add_port(server, f"{host}:{port}")
    except RuntimeError:  # taken between the check and the bind
        bound = 0
    if bound == 0:
        raise PortUnavailable(host, port, flag, OSError(errno.EADDRINUSE, "in use"))
    return bound


def check_health(address: str, timeout_s: float = 1.0, service: str = "",
                 security: LinkSecurity | None = None) -> bool:
    """True if the service at address answers SERVING."""
    with (security or LinkSecurity()).channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
