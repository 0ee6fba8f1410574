"""Who the caller is: API keys (--api-key, several allowed) checked on every HTTP
route but /health, /ping and /metrics (sent as `Authorization: Bearer <key>` or, as
Anthropic's SDK does, `x-api-key: <key>`) and on every gRPC Generation call (the
`authorization` metadata); priority claims other than the default need a key
listed in --priority-keys.

With no key configured there is no authentication and any caller may set a
priority (a development set-up on loopback; docs/security.md).

Tenancy (--prefix-cache-scope key, the default): each key gets its own prefix
cache, so one key cannot probe another's prompts through `cached_tokens` or TTFT.
identify() records the caller's scope in a context variable (the request's task
and the tasks it spawns see it); the engine client salts what it sends with it."""

from __future__ import annotations

import contextvars
import hashlib
import hmac
from dataclasses import dataclass

from frontend_svc.request.caps import REJECTED

ANONYMOUS = ""  # the caller when authentication is off
SCOPES = ("key", "global")
# the caller's prefix-cache scope: a digest of its key, or None (one shared scope)
_CACHE_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "gapserve_cache_scope", default=None)


def key_scope(key: str) -> str:
    """A stable, one-way name for a key's cache scope: the raw key never goes on the
    wire, and every frontend of a deployment derives the same one."""
    return "key:" + hashlib.sha256(b"gapserve prefix-cache scope\0" + key.encode()).hexdigest()[:32]


def scoped_cache_salt(user_salt: str | None) -> str | None:
    """The salt the scheduler hashes: the caller's scope, then the client's own
    `cache_salt` (which scopes within the key); unchanged when there is no scope."""
    scope = _CACHE_SCOPE.get()
    if scope is None:
        return user_salt
    return scope if user_salt is None else f"{scope}\0{user_salt}"


class Unauthenticated(Exception):
    status = 401


class Forbidden(Exception):
    status = 403


def bearer(value: str | bytes | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def presented_key(authorization: bytes | str | None,
                  x_api_key: bytes | str | None) -> str | None:
    """The key a caller sends: `Authorization: Bearer <key>` (OpenAI's clients), else
    `x-api-key: <key>` (Anthropic's SDK, whose `api_key=` sends only that header). A
    bearer token, when there is one, is the key: a second header never overrides it."""
    token = bearer(authorization)
    if token is not None:
        return token
    if isinstance(x_api_key, bytes):
        x_api_key = x_api_key.decode("latin-1")
    return x_api_key.strip() or None if x_api_key else None


@dataclass(frozen=True, slots=True)
class ApiKeys:
    keys: tuple[str, ...] = ()
    priority_keys: tuple[str, ...] = ()
    cache_scope: str = "key"  # --prefix-cache-scope

    @classmethod
    def from_args(cls, args) -> "ApiKeys":
        return cls(tuple(args.api_key or ()), tuple(args.priority_keys or ()),
                   getattr(args, "prefix_cache_scope", "key"))

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.priority_keys)

    def identify(self, token: str | None) -> str:
        """The caller's key; raises Unauthenticated for a missing or unknown one."""
        _CACHE_SCOPE.set(None)  # no scope until a key is proven
        if not self.enabled:
            return ANONYMOUS
        if token is None:
            REJECTED.labels("unauthenticated").inc()
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>` "
                                  "or `x-api-key: <key>`")
        if not _one_of(token, self.keys + self.priority_keys):
            REJECTED.labels("unauthenticated").inc()
            raise Unauthenticated("incorrect API key provided")
        if self.cache_scope == "key":
            _CACHE_SCOPE.set(key_scope(token))
        return token

    def check_priority(self, caller: str, priority: int) -> None:
        """Priority is a claim on other tenants' capacity: only allowed keys make it."""
        if priority == 0 or not self.enabled or _one_of(caller, self.priority_keys):
            return
        REJECTED.labels("priority").inc()
        raise Forbidden("this API key may not set a request priority "
                        "(it is not one of --priority-keys)")


def _one_of(token: str, keys: tuple[str, ...]) -> bool:
    # compare with every key in constant time: no early exit that leaks which matched
    found = False
    for key in keys:
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found
