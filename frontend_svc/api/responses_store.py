"""Stored responses (`store`, `previous_response_id`, GET/DELETE
/v1/responses/{id}): in this process's memory, bounded in entries and age, so a
busy server cannot grow without limit. Lost on restart and not shared between
frontends (docs/api.md says so); vLLM's store is in memory too."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from frontend_svc.telemetry.observe import log

MAX_STORED_RESPONSES = 1024
MAX_STORED_AGE_S = 3600.0


@dataclass(slots=True)
class Stored:
    response: dict  # the Response object as returned
    messages: list[dict]  # the conversation up to and including its output, as chat messages
    stored_at: float


class ResponseStore:
    """Insertion-ordered, so the oldest entry is evicted first, in O(1)."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES,
                 max_age_s: float = MAX_STORED_AGE_S, clock=time.monotonic) -> None:
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, resp_id: str, response: dict, messages: list[dict]) -> None:
        self._expire()
        self._entries[resp_id] = Stored(response, messages, self.clock())
        self._entries.move_to_end(resp_id)
        while len(self._entries) > self.max_entries:
            evicted, _ = self._entries.popitem(last=False)
            log.info("stored response evicted", response_id=evicted,
                     reason="max_entries", max_entries=self.max_entries)

    def get(self, resp_id: str) -> Stored | None:
        self._expire()
        return self._entries.get(resp_id)

    def delete(self, resp_id: str) -> bool:
        return self._entries.pop(resp_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        cutoff = self.clock() - self.max_age_s
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.stored_at > cutoff:
                return
            del self._entries[oldest_id]
            log.info("stored response expired", response_id=oldest_id,
                     max_age_s=self.max_age_s)
