"""A port a service listens on is its own: bound exclusively, and a busy one refused
in one line that names the port and the flag (and environment variable) that moves
it, before the service announces anything.

Exclusive means no SO_REUSEPORT: with it (gRPC's default) a second server silently
shares the port and the kernel splits the connections between the two. SO_REUSEADDR
stays: on Linux it only lets a port in TIME_WAIT be bound again, never a listening one.
"""

from __future__ import annotations

import errno
import socket

from shared.flag_spec import env_name


class PortUnavailable(OSError):
    """A port this service must listen on cannot be bound: taken (by another process,
    or by a second copy of this one), privileged, or on an address not of this host."""

    def __init__(self, host: str, port: int, flag: str, error: OSError) -> None:
        self.host, self.port, self.flag = host, port, flag
        self.in_use = error.errno == errno.EADDRINUSE
        flags = f"{flag} (or {env_name(flag)})"
        message = f"port {port} on {host} is already in use; choose another with {flags}" \
            if self.in_use else \
            f"port {port} on {host} cannot be bound ({error.strerror or error}); {flags} sets it"
        super().__init__(error.errno, message)

    def __str__(self) -> str:
        return self.strerror


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bind_host(host: str) -> str:
    return host.strip("[]")  # "[::1]" in a gRPC address is "::1" to a socket


def listening_socket(host: str, port: int, flag: str, *, reuse_port: bool = False,
                     backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on host:port, or PortUnavailable. reuse_port: for the
    --api-server-count frontends that share one port on purpose."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((_bind_host(host), port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise PortUnavailable(host, port, flag, e) from None
    sock.setblocking(False)
    return sock


def check_free(host: str, port: int, flag: str, *, reuse_port: bool = False) -> None:
    """Raise PortUnavailable unless host:port can be bound exclusively now (reuse_port:
    shared with our siblings only). Port 0 (any free one) always can. Called right
    before a library (gRPC, the metrics server) binds it, so the refusal is our one
    line and not the library's traceback or log."""
    if port:
        listening_socket(host, port, flag, reuse_port=reuse_port, backlog=1).close()
