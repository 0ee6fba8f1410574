"""Stop strings: found across token boundaries, withheld from the output.

Text that could still become a stop string (a suffix that is a prefix of one) is
held back from a stream until the next tokens decide it. Both checks look only at
the last max(len(stop)) characters, so the work per token is linear in the stop
strings' lengths and does not grow with the text (a hostile stop list cannot
make the frontend's event loop quadratic).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopMatch:
    index: int  # where the stop string starts in the text
    stop: str


def _prefix_function(s: str) -> list[int]:
    """KMP: pi[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


@dataclass(slots=True)
class StopStrings:
    stops: list[str]
    _pi: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._pi = [_prefix_function(s) for s in self.stops]

    @property
    def max_holdback(self) -> int:
        return max((len(s) - 1 for s in self.stops), default=0)

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
        """How many trailing characters of `text` might begin a stop string: at
        most max(len(stop)) - 1, found with one KMP pass per stop over that tail."""
        longest = 0
        for stop, pi in zip(self.stops, self._pi):
            tail = text[len(text) - min(len(text), len(stop) - 1):]
            k = 0  # length of the longest prefix of `stop` ending here
            for ch in tail:
                while k and (k == len(stop) or ch != stop[k]):
                    k = pi[k - 1]
                if ch == stop[k]:
                    k += 1
            longest = max(longest, min(k, len(stop) - 1))
        return longest
