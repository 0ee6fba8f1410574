"""The value types of our command-line flags (argparse `type=` functions): each turns
one flag's text into its value or raises argparse.ArgumentTypeError with the reason.
shared/config.py declares the flags; these check what they hold.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def niceness(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"must be a niceness from 0 to 19, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0.0 or value == float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def address_list(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for a in addresses:
        host, sep, p = a.rpartition(":")
        if not sep or not host or not p.isdigit():
            raise argparse.ArgumentTypeError(f"{a!r} is not host:port")
    if not addresses:
        raise argparse.ArgumentTypeError("needs at least one host:port")
    return addresses


# --- spare workers (issue 14, docs/resilience.md): `;` separates worker groups
class WorkerGroups(list):
    """--worker-addresses: the first group's addresses (one per tensor-parallel rank),
    so callers that knew only one group read it as before; `.groups` holds every
    group in order, the first active at start and the others spares."""

    def __init__(self, groups: Sequence[Sequence[str]]) -> None:
        super().__init__(groups[0])
        self.groups = [list(g) for g in groups]


def worker_groups(groups: Sequence[str] | WorkerGroups) -> list[list[str]]:
    """Every group of a --worker-addresses value (a plain list is one group)."""
    return [list(g) for g in getattr(groups, "groups", [groups])]


def address_groups(text: str) -> WorkerGroups:
    """`w0:1,w1:2;s0:1,s1:2`: groups of host:port separated by `;`."""
    groups = [address_list(part) for part in text.split(";") if part.strip()]
    if not groups:
        raise argparse.ArgumentTypeError("needs at least one host:port")
    sizes = [len(g) for g in groups]
    if len(set(sizes)) > 1:  # a spare replaces the whole tensor-parallel worker
        raise argparse.ArgumentTypeError(
            f"every worker group (separated by ';') needs one address per tensor-parallel "
            f"rank, the same number in each, but the groups have {sizes} addresses")
    flat = [a for g in groups for a in g]
    twice = sorted({a for a in flat if flat.count(a) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} listed more than once")
    return WorkerGroups(groups)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def readable_file(text: str) -> str:
    try:
        with open(text, encoding="utf-8") as f:
            f.read(1)
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {e}") from None
    return os.path.abspath(text)  # children of `gapserve serve` read it too


def key_list(text: str) -> list[str]:
    """Comma-separated secrets; empty entries dropped (an empty variable = none)."""
    return [k.strip() for k in text.split(",") if k.strip()]


def endpoint_list(text: str) -> list[str]:
    """Comma-separated ZMQ endpoints (tcp://host:port, ipc://path)."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    for e in endpoints:
        if "://" not in e:
            raise argparse.ArgumentTypeError(f"{e!r} is not a ZMQ endpoint such as "
                                             f"tcp://host:5557")
    return endpoints


def routing_threshold(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def relative_threshold(text: str) -> float:
    value = float(text)
    if not value >= 1.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 1, got {text}")
    return value
