"""The process's compiled grammars (vLLM's structured_output manager): one cache
in front of the backend (llguidance_backend.py) with its own compile threads and
metrics. The frontend validates a request's spec through it before anything is
queued, so a bad schema, regex, choice list or grammar is a 400 / INVALID_ARGUMENT
naming it; the worker compiles the same spec through the same code (`compile_spec`)
and copies the pristine matcher per request, so it never judges a spec differently."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from shared.config import DEFAULT_COMPILE_TIMEOUT_S
from shared.structured.backend import CompiledGrammar, GrammarBackend, GrammarVocab
from shared.structured.llguidance_backend import LLGuidanceBackend
from shared.structured.spec import CACHE_SIZE, CompileCapacityError, StructuredOutputError, \
    StructuredOutputSpec, error_field

# Per process: the frontend's validation and rank 0's compiles each count their own.
COMPILE_TIME = Histogram("gapserve:structured_output_compile_seconds",
                         "Time to compile one structured-output grammar (a cache miss).",
                         ["kind"], buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                            0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
CACHE_LOOKUPS = Counter("gapserve:structured_output_cache",
                        "Compiled-grammar cache lookups, by result (hit, miss).", ["result"])
STUCK_COMPILES = Gauge("gapserve:structured_output_stuck_compiles",
                       "Grammar compiles still running past the compile timeout, each on a "
                       "thread outside the compile pool's (at the cap, new grammars are "
                       "refused).")

# Compiles a process runs at once, and how many compiles past the timeout it lets run
# beside them (a compile cannot be interrupted): at that many, a new grammar is
# refused (CompileCapacityError) until one of them ends.
COMPILE_THREADS = 2
MAX_STUCK_COMPILES = 4


@dataclass(eq=False)
class _Job:
    """One compile: queued, then running on a thread of its own."""

    key: tuple
    spec: StructuredOutputSpec
    vocab: GrammarVocab
    future: Future = dataclasses.field(default_factory=Future)
    started: float | None = None  # time.monotonic() when its thread started
    stuck: bool = False  # ran past the timeout: its thread no longer counts


class CompileCache:
    """Compiled grammars by (vocab, spec), LRU, thread-safe; a spec compiled by a
    concurrent caller is awaited rather than compiled twice. Counts hits and misses
    (gapserve:structured_output_cache_total{result}) and times compiles.

    At most `threads` compiles run at once. A compile cannot be interrupted, so one
    that runs past the compile timeout (its caller gave up, or it has run longer
    than `stuck_after_s`) is set aside: its thread stops counting against `threads`,
    so the next grammar starts at once, and it ends on its own (counted in
    gapserve:structured_output_stuck_compiles meanwhile). While `max_stuck` are set
    aside, a grammar not yet compiled or compiling is refused with
    CompileCapacityError instead of queueing behind them: a few hostile schemas cost
    at most `threads + max_stuck` threads, never every later compile."""

    def __init__(self, size: int = CACHE_SIZE, threads: int = COMPILE_THREADS,
                 max_stuck: int = MAX_STUCK_COMPILES,
                 stuck_after_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 backend: GrammarBackend | None = None) -> None:
        self.backend = backend or BACKEND
        self.size = size
        self.threads = threads
        self.max_stuck = max_stuck
        # the process's compile timeout: each service's main sets its flag's value
        self.stuck_after_s = stuck_after_s
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple, _Job] = {}  # queued or running
        self._queue: deque[_Job] = deque()
        self._running: set[_Job] = set()  # counted against `threads`
        self.stuck = 0
        self.hits = 0
        self.misses = 0

    def lookup(self, spec: StructuredOutputSpec, vocab: GrammarVocab) -> CompiledGrammar | None:
        """The compiled grammar when cached (counts a hit), else None (no count)."""
        with self._lock:
            return self._hit((vocab.model_dir, vocab.vocab_size, spec.key()))

    def _hit(self, key) -> CompiledGrammar | None:
        """Under the lock: the cached grammar, counted and made the most recent."""
        got = self._done.get(key)
        if got is not None:
            self._done.move_to_end(key)
            self._count(True)
        return got

    def submit(self, spec: StructuredOutputSpec, vocab: GrammarVocab) -> Future:
        """A future of the compiled grammar: done at once on a hit; on a miss the
        compile runs on a thread of the cache's (joined by concurrent askers); failed
        at once with CompileCapacityError while max_stuck compiles are set aside."""
        return self._submit(spec, vocab)[0]

    def _submit(self, spec: StructuredOutputSpec, vocab: GrammarVocab) -> tuple[Future, bool]:
        key = (vocab.model_dir, vocab.vocab_size, spec.key())
        with self._lock:
            got = self._hit(key)
            if got is not None:
                future: Future = Future()
                future.set_result(got)
                return future, True
            self._count(False)
            self._set_aside_overdue()
            job = self._pending.get(key)
            if job is None:
                if self.stuck >= self.max_stuck:
                    future = Future()
                    future.set_exception(CompileCapacityError(
                        f"{self.stuck} grammar compiles are still running past the compile "
                        "timeout; no new grammar is compiled until one ends: retry later"))
                    return future, False
                job = _Job(key, spec, vocab)
                self._pending[key] = job
                self._queue.append(job)
                self._dispatch()
            return job.future, False

    def compile(self, spec: StructuredOutputSpec, vocab: GrammarVocab,
                timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """The compiled grammar, compiling it (off the caller's thread, bounded by
        timeout_s) on a miss; raises StructuredOutputError."""
        return self.fetch(spec, vocab, timeout_s)[0]

    def fetch(self, spec: StructuredOutputSpec, vocab: GrammarVocab,
              timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> tuple[CompiledGrammar, bool]:
        """compile(), and whether it was a cache hit. A compile still running when
        timeout_s ends is set aside (its thread stops counting)."""
        future, hit = self._submit(spec, vocab)
        try:
            return future.result(timeout=timeout_s), hit
        except FutureTimeout:
            with self._lock:
                job = self._pending.get((vocab.model_dir, vocab.vocab_size, spec.key()))
                if job is not None and job.future is future and job in self._running:
                    self._set_aside(job)
            raise StructuredOutputError(
                f"the {spec.kind} grammar did not compile within {timeout_s:g} s; "
                "simplify it", error_field(spec)
            ) from None

    def _count(self, hit: bool) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        CACHE_LOOKUPS.labels("hit" if hit else "miss").inc()

    # under self._lock
    def _dispatch(self) -> None:
        while self._queue and len(self._running) < self.threads:
            job = self._queue.popleft()
            job.started = time.monotonic()
            self._running.add(job)
            threading.Thread(target=self._run, args=(job,), name="grammar-compile",
                             daemon=True).start()  # daemon: a stuck one never holds exit

    def _set_aside_overdue(self) -> None:
        now = time.monotonic()
        for job in [j for j in self._running if now - j.started > self.stuck_after_s]:
            self._set_aside(job)

    def _set_aside(self, job: _Job) -> None:
        self._running.discard(job)
        job.stuck = True
        self.stuck += 1
        STUCK_COMPILES.inc()
        _log().warning("grammar_compile_stuck", kind=job.spec.kind, stuck=self.stuck,
                       max_stuck=self.max_stuck,
                       running_s=round(time.monotonic() - job.started, 3))
        self._dispatch()

    def _run(self, job: _Job) -> None:
        try:
            compiled, error = self.backend.compile(job.spec, job.vocab), None
        except BaseException as exc:  # noqa: BLE001 - the askers get it
            compiled, error = None, exc
        with self._lock:
            self._pending.pop(job.key, None)
            if job.stuck:
                self.stuck -= 1
                STUCK_COMPILES.dec()
            else:
                self._running.discard(job)
            if compiled is not None:
                self._done[job.key] = compiled
                while len(self._done) > self.size:
                    self._done.popitem(last=False)
            self._dispatch()
        if compiled is None:
            job.future.set_exception(error)
            return
        COMPILE_TIME.labels(job.spec.kind).observe(compiled.compile_s)
        job.future.set_result(compiled)


def _log():
    from shared.telemetry import get_logger
    return get_logger(component="structured_output")


BACKEND: GrammarBackend = LLGuidanceBackend()  # the one backend this build has
CACHE = CompileCache()


def grammar_vocab(model_dir, vocab_size: int | None = None,
                  eos_token_ids: list[int] | None = None) -> GrammarVocab:
    """The backend's vocabulary for a checkpoint directory, built once a process.
    vocab_size: the model's logits width when it exceeds the tokenizer's (padded
    embeddings); eos_token_ids: the model's, else the checkpoint's config."""
    return BACKEND.vocab(model_dir, vocab_size, eos_token_ids)


def compile_spec(spec: StructuredOutputSpec, vocab: GrammarVocab,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> CompiledGrammar:
    """The compiled grammar through the process's cache (the worker's path)."""
    return CACHE.compile(spec, vocab, timeout_s)


def validate(spec: StructuredOutputSpec, vocab: GrammarVocab,
             timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> bool:
    """Compile the spec (through the cache) with a timeout; raise
    StructuredOutputError naming the problem (CompileCapacityError: none can be
    compiled now). Returns whether it was a cache hit; changes nothing else."""
    return CACHE.fetch(spec, vocab, timeout_s)[1]
