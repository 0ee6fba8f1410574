"""Security of the gRPC links between our services, built in one place from the
--tls-cert/--tls-key/--tls-ca/--internal-token flags so every server and channel
uses the same rules:

- no TLS flags: plaintext (loopback or a private network only; docs/security.md);
- --tls-cert + --tls-key: servers speak TLS; clients verify them with --tls-ca
  (or the system roots);
- plus --tls-ca: mutual TLS: servers also require a client certificate signed by
  --tls-ca, and clients present --tls-cert;
- --internal-token: the scheduler and workers refuse calls (health checks aside)
  that do not carry it in the `x-gapserve-internal-token` metadata.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

TOKEN_METADATA = "x-gapserve-internal-token"
# Probes and discovery stay open: they reveal nothing and drive nothing.
OPEN_SERVICES = ("/grpc.health.v1.", "/grpc.reflection.")


@dataclass(frozen=True, slots=True)
class LinkSecurity:
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    token: str | None = None

    @classmethod
    def from_args(cls, args) -> "LinkSecurity":
        cert, key, ca = (getattr(args, name, None) for name in ("tls_cert", "tls_key", "tls_ca"))
        if bool(cert) != bool(key):
            raise ValueError("--tls-cert and --tls-key go together")
        read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
        return cls(read(cert), read(key), read(ca), getattr(args, "internal_token", None) or None)

    @property
    def tls(self) -> bool:
        return self.cert is not None

    # ---- servers

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca,
            require_client_auth=self.ca is not None)

    def add_port(self, server, address: str) -> int:
        """server.add_(in)secure_port for a sync or asyncio server; 0 if it cannot bind."""
        creds = self.server_credentials()
        if creds is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, creds)

    def interceptors(self) -> list:
        """For the inner services' sync servers: the internal-token check."""
        return [InternalTokenInterceptor(self.token)] if self.token else []

    # ---- clients

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        # under mTLS we present our certificate; otherwise only verify the server's
        mutual = self.ca is not None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key if mutual else None,
            certificate_chain=self.cert if mutual else None)

    def channel(self, address: str, options=(), aio: bool = False):
        module = grpc.aio if aio else grpc
        creds = self.channel_credentials()
        if creds is None:
            return module.insecure_channel(address, options=list(options))
        return module.secure_channel(address, creds, options=list(options))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call to an inner service carries."""
        return ((TOKEN_METADATA, self.token),) if self.token else ()


def is_loopback(host: str) -> bool:
    """An address only this machine reaches (a name other than localhost is not)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def inner_bind_problem(host: str, security: LinkSecurity, allow_insecure: bool) -> str | None:
    """Why a scheduler or worker must not listen on `host`, or None. Off loopback,
    anyone on the network could open an Engine Session (skipping API keys, caps and
    priority rules) or take the worker's one Step stream, so callers must prove
    themselves: the internal token, or a client certificate (mTLS)."""
    if allow_insecure or is_loopback(host) or security.token or \
            (security.tls and security.ca is not None):
        return None
    return (f"refusing to listen on {host!r} without authentication: any host on that "
            "network could drive this service. Set --internal-token (or the "
            "GAPSERVE_INTERNAL_TOKEN variable) on every service, or mTLS (--tls-cert, "
            "--tls-key, --tls-ca), or pass --allow-insecure-inner if the network is "
            "trusted (docs/security.md)")


class InternalTokenInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) any call without the shared token, so a stray
    client on the network cannot submit steps to a worker or requests to the scheduler."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        given = dict(details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        if hmac.compare_digest(given.encode(), self._token):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def deny(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "this service requires the internal token (--internal-token)")

    def deny_stream(request, context):
        deny(request, context)
        yield  # pragma: no cover - abort raised

    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
