"""A cheap checksum of a request's token ids, computed the same way on both sides of
the scheduler -> worker hop. A resumed request carries the scheduler's (count,
checksum); the worker compares it with its own token list, so a drift between the
two fails the step it happens in instead of silently changing the output."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def token_checksum(token_ids: Sequence[int]) -> int:
    """64 bits of BLAKE2b over the ids as fixed-width integers (C speed, O(n) once per
    resume)."""
    digest = hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
