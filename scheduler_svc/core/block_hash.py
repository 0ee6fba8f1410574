"""The prefix-cache hash chain: one hash per full block of a request's committed tokens.

hash(block i) = SHA-256(hash(block i-1) || token ids of block i || extra keys), where the
chain starts from a per-deployment seed and the first block's extra keys carry the
request's cache salt (the chain carries it to every later block), and under longrope
whether the prompt is past the pretraining length (its every token rotates otherwise). SHA-256 because a
client must not be able to force a collision and read another tenant's KV.
"""

from __future__ import annotations

import hashlib
from array import array

from scheduler_svc.core.request import Request


class BlockHasher:
    """Extends request.block_hashes incrementally as tokens are committed."""

    __slots__ = ("block_size", "root", "long_prompt_rope_from")

    def __init__(self, block_size: int, seed: str, long_prompt_rope_from: int = 0) -> None:
        self.block_size = block_size
        self.root = hashlib.sha256(b"gapserve-prefix-cache\x00" + seed.encode()).digest()
        # longrope: a prompt longer than this has every token rotated with the long
        # factors (worker_svc/model/layers.py longrope_rows): other KV, another chain
        self.long_prompt_rope_from = long_prompt_rope_from

    def __call__(self, request: Request) -> None:
        hashes = request.block_hashes
        size = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * size <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else self.root
            h = hashlib.sha256(parent)
            # Fixed-width ids keep the encoding unambiguous (no separators needed).
            h.update(array("q", tokens[i * size:(i + 1) * size]).tobytes())
            if i == 0 and request.cache_salt is not None:
                h.update(b"\x01salt")
                h.update(request.cache_salt.encode())
            if i == 0 and 0 < self.long_prompt_rope_from < request.num_prompt_tokens:
                h.update(b"\x02longrope")
            hashes.append(h.digest())
        request.next_hash_at = (len(hashes) + 1) * size
