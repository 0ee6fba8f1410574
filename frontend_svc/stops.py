"""Stop strings: found across token boundaries, withheld from the output.

Text that could still become a stop string (a suffix that is a prefix of one) is
held back from a stream until the next tokens decide it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopMatch:
    index: int  # where the stop string starts in the text
    stop: str


@dataclass(slots=True)
class StopStrings:
    stops: list[str]

    def find(self, text: str, num_new_chars: int) -> StopMatch | None:
        """The earliest stop string that ends inside the last `num_new_chars`
        characters of `text` (earlier text was already checked)."""
        if not self.stops or num_new_chars <= 0:
            return None
        best: StopMatch | None = None
        for stop in self.stops:
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index >= 0 and (best is None or index < best.index):
                best = StopMatch(index, stop)
        return best

    def holdback(self, text: str) -> int:
        """How many trailing characters of `text` might begin a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
