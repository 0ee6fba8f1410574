"""What the engine's failures are, in the one vocabulary the engine loop, the worker
group and every protocol's servicer share: why a request ended without an output
(ErrorCode, Failure, mapped to gRPC codes by each servicer), why the engine itself
stopped or recovers (EngineFailed, WorkerLost, WorkerDisagreement, Overloaded), and
the one-line description of an error a client or a log gets (describe)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc


class ErrorCode(enum.Enum):
    """Why a request ended without an output; the server maps it to a gRPC code."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INTERNAL = "INTERNAL"  # it broke the workers' steps (docs/resilience.md)

    @property
    def status_code(self) -> grpc.StatusCode:
        """The gRPC code of the same name, which every protocol's servicer answers."""
        return grpc.StatusCode[self.value]


@dataclass(slots=True)
class Failure:
    req_id: str
    code: ErrorCode
    message: str


def describe(error: BaseException) -> str:
    """One clean line for a client or a log: never the repr of a gRPC call object."""
    code, details = getattr(error, "code", None), getattr(error, "details", None)
    if callable(code) and callable(details):  # a grpc.RpcError
        try:
            return f"{code().name}: {details()}"
        except Exception:  # noqa: BLE001 - not a finished call after all
            pass
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return text if text and not text.startswith("<") else type(error).__name__


class EngineFailed(RuntimeError):
    """The worker group is gone; the scheduler cannot make progress any more."""


class Overloaded(RuntimeError):
    """The scheduler already holds its bound of open requests (every frontend's)."""


class WorkerLost(EngineFailed):
    """A worker's Step stream ended, or a step passed --step-timeout-s: the workers'
    state is gone, and the engine recovers by recompute (docs/resilience.md)."""


class WorkerDisagreement(WorkerLost):
    """The workers' answer contradicts the scheduler (a stop decided otherwise, a token
    count, another step): their state is not to be trusted, so the engine recovers as
    from a lost worker: the streams are reopened (the worker drops its requests) and
    every request is recomputed from the scheduler's tokens (docs/scheduling.md).
    `sides` maps each request named to both sides' tokens."""

    def __init__(self, message: str, sides: dict[str, dict] | None = None) -> None:
        super().__init__(message)
        self.sides = sides or {}
