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
    """One request's stop strings. holdback() keeps a KMP automaton per stop and
    feeds it only the characters appended since its last call: O(new characters x
    stops) per token, whatever the stops or the text (a call with text that does
    not extend the last one restarts on its last max(len(stop)) characters)."""

    stops: list[str]
    _pi: list[list[int]] = field(init=False, repr=False)
    _state: list[int] = field(init=False, repr=False)  # matched prefix length per stop
    _window: int = field(init=False, repr=False)  # the state depends on this many chars
    _fed: int = field(default=0, init=False, repr=False)
    _tail: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        self._pi = [_prefix_function(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self._window = max((len(s) for s in self.stops), default=0)

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
        """How many trailing characters of `text` might begin a stop string
        (at most max(len(stop)) - 1)."""
        if not self.stops:
            return 0
        fed = self._fed
        if fed > len(text) or not text.startswith(self._tail, fed - len(self._tail)):
            fed = -1  # not a continuation of the text seen so far
        start = max(fed, len(text) - self._window)
        if start != fed:
            self._state = [0] * len(self.stops)  # restart on the window: same result
        new = text[start:]
        longest = 0
        for j, (stop, pi) in enumerate(zip(self.stops, self._pi)):
            k, size = self._state[j], len(stop)
            for ch in new:
                if k == size:
                    k = pi[k - 1]
                while k and ch != stop[k]:
                    k = pi[k - 1]
                if ch == stop[k]:
                    k += 1
            self._state[j] = k
            # a whole stop ending here (unchecked before min_tokens) is no hold-back
            longest = max(longest, pi[k - 1] if k == size else k)
        self._fed, self._tail = len(text), text[len(text) - min(len(text), self._window):]
        return longest
