"""Time the n-gram proposer (worker_svc/spec/ngram.py) on contexts of a few lengths:
random tokens (few matches: the common case of prose) and text that repeats (many
candidate positions survive the first comparison: the worst case), k = 5, n in [1, 5]
and [3, 5]. Prints microseconds per call (median of repeats).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ngram_proposer.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from worker_svc.spec.ngram import propose


def _time(tokens: np.ndarray, min_n: int, max_n: int, repeats: int = 200) -> float:
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            propose(tokens, 5, min_n, max_n)
        runs.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(runs)


def main() -> None:
    rng = np.random.default_rng(0)
    print("| context | tokens | n 1-5 µs | n 3-5 µs |")
    print("|---|--:|--:|--:|")
    for length in (512, 2048, 8192, 32768):
        cases = {
            "random (vocab 49k)": rng.integers(0, 49152, length),
            "repeating (a 50-token phrase, 3% edits)": _repeating(rng, length),
            "tiny vocab (16 ids)": rng.integers(0, 16, length),
        }
        for name, tokens in cases.items():
            tokens = tokens.astype(np.int64)
            print(f"| {name} | {length:,} | {_time(tokens, 1, 5):.1f} | {_time(tokens, 3, 5):.1f} |")


def _repeating(rng: np.random.Generator, length: int) -> np.ndarray:
    phrase = rng.integers(0, 49152, 50)
    out = np.resize(phrase, length).copy()
    edits = rng.random(length) < 0.03
    out[edits] = rng.integers(0, 49152, int(edits.sum()))
    return out


if __name__ == "__main__":
    main()
