"""Errors as clients see them: OpenAI's error JSON with the right HTTP code, and
the mapping from scheduler gRPC status codes to HTTP."""

from __future__ import annotations

import grpc

from shared.types import InvalidRequestError

HTTP_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
               499: "client_closed_request", 500: "server_error",
               503: "service_unavailable", 504: "timeout"}
_CODES_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


class FieldError(InvalidRequestError):
    """A 400 about one request field: `param` names it, as OpenAI's error body does."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class EngineError(Exception):
    """A request ended with a gRPC status from the scheduler (or its session)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def from_number(cls, number: int, message: str) -> "EngineError":
        return cls(_CODES_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message)

    @property
    def http_status(self) -> int:
        return HTTP_FROM_GRPC.get(self.code, 500)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": status}}
