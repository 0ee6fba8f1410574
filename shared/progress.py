"""Progress of a long step on a terminal or in a log: `with Progress("converting", n) as p:
p.advance()`. On a terminal one line redrawn as a bar; otherwise a line every 10 %, so
a log shows the step moving without thousands of lines. Also the step's start and end
with its duration: an operator sees what the wait is for and how long it took."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30  # characters of the bar
LOG_STEP = 10  # percent between lines when not on a terminal


class Progress:
    def __init__(self, what: str, total: int, stream: TextIO | None = None,
                 prefix: str = "gapserve") -> None:
        self.what, self.total, self.prefix = what, max(total, 1), prefix
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = 0
        self._said = -1  # last percentage written (log mode)
        self._start = 0.0

    def __enter__(self) -> "Progress":
        self._start = time.monotonic()
        if self.tty:
            self.advance(0)
        else:
            self._write(f"{self.prefix}: {self.what}: 0%")
            self._said = 0
        return self

    def advance(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        pct = self.done * 100 // self.total
        if self.tty:
            filled = WIDTH * self.done // self.total
            bar = "#" * filled + "." * (WIDTH - filled)
            self.stream.write(f"\r{self.prefix}: {self.what} [{bar}] {pct:3d}%")
            self.stream.flush()
        elif pct >= self._said + LOG_STEP:
            self._said = pct - pct % LOG_STEP
            self._write(f"{self.prefix}: {self.what}: {self._said}%")

    def __exit__(self, kind, *_) -> None:
        if self.tty:
            self.stream.write("\n")
        seconds = time.monotonic() - self._start
        outcome = "done" if kind is None else "failed"
        self._write(f"{self.prefix}: {self.what}: {outcome} in {seconds:.1f} s")

    def _write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
