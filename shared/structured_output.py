"""Structured outputs: what a request asks its output to match, and the one place
that turns such a spec into a grammar the backend (llguidance) can enforce.

A `StructuredOutputSpec` travels with the SamplingParams on every hop (frontend ->
scheduler -> worker). The frontend calls `validate()` before anything is queued, so
a bad schema, regex, choice list or grammar is a 400 / INVALID_ARGUMENT naming it.
The worker compiles the same spec through the same cache (`compile_spec`) and gets
a pristine matcher to copy per request; it never re-validates differently from the
frontend, because both go through `_grammar_text` and `_compile`.

Why llguidance (docs/structured_outputs.md has the numbers): its wheel has no
dependencies (xgrammar's metadata pulls triton), its compile is ~5x faster at the
tail, and its mask, though slower than xgrammar's per call, is tens of microseconds
for this vocabulary, far below a step.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

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

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# Seconds a compile may take before the request is refused (the frontend's and the
# worker's); shared.config's --structured-output-compile-timeout overrides it.
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# How many compiled grammars stay cached (per process): a compiled matcher is a few
# hundred KB for a nested schema; 256 is a few tens of MB at most.
CACHE_SIZE = 256
# Compiles a process runs at once, and how many compiles past the timeout it lets run
# beside them (a compile cannot be interrupted): at that many, a new grammar is
# refused (CompileCapacityError) until one of them ends.
COMPILE_THREADS = 2
MAX_STUCK_COMPILES = 4
# Whitespace between JSON tokens when the client does not forbid it: bounded, so a
# small model cannot pad forever ("runaway whitespace"); one newline and up to 12
# spaces or tabs per gap keeps pretty-printed JSON (indented a few levels) possible.
BOUNDED_WHITESPACE = r"\n?[ \t]{0,12}"


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match. `value` per kind: JSON-schema text ("json"),
    a regex ("regex"), a JSON array of strings ("choice"), a Lark/EBNF grammar as
    llguidance takes it ("grammar"), "" for any JSON object ("json_object")."""

    kind: str
    value: str = ""
    disable_any_whitespace: bool = False

    def key(self) -> tuple[str, str, bool]:
        return (self.kind, self.value, self.disable_any_whitespace)


class StructuredOutputError(ValueError):
    """A spec that cannot be enforced; `field` names the spec part at fault (the
    kind: "json", "regex", "choice", "grammar", or "structured_output")."""

    def __init__(self, message: str, field: str = "structured_output") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class CompileCapacityError(StructuredOutputError):
    """No grammar can be compiled now: the cache's limit of compiles running past
    the timeout is reached (CompileCache). Not the spec's fault: HTTP 503 / gRPC
    RESOURCE_EXHAUSTED, and a retry can succeed once one of them ends."""


@dataclass(frozen=True)
class GrammarVocab:
    """The backend's tokenizer info for one model (llguidance's LLTokenizer: ~1 s to
    build for a 49k vocabulary, so one per model and process)."""

    model_dir: str
    tokenizer: object  # llguidance.LLTokenizer
    vocab_size: int
    eos_token_ids: tuple[int, ...]


_VOCABS: dict[tuple[str, int | None], GrammarVocab] = {}
_VOCAB_LOCK = threading.Lock()


def grammar_vocab(model_dir, vocab_size: int | None = None,
                  eos_token_ids: list[int] | None = None) -> GrammarVocab:
    """The tokenizer info for a checkpoint directory, built once and cached.
    vocab_size: the model's logits width when it exceeds the tokenizer's (padded
    embeddings); eos_token_ids: the model's, else the checkpoint's config (the first
    build of a directory fixes them)."""
    path = str(Path(model_dir).resolve())
    with _VOCAB_LOCK:  # one build a model: the tokenizer's own size and None share it
        vocab = _VOCABS.get((path, vocab_size)) or _VOCABS.get((path, None))
        if vocab is None or (vocab_size is not None and vocab.vocab_size != vocab_size):
            vocab = _build_vocab(Path(path), vocab_size, eos_token_ids)
        _VOCABS[(path, vocab_size)] = _VOCABS[(path, vocab.vocab_size)] = vocab
        if vocab_size is None:
            _VOCABS[(path, None)] = vocab
        return vocab


def _build_vocab(path: Path, vocab_size: int | None,
                 eos_token_ids: list[int] | None) -> GrammarVocab:
    import llguidance

    tokenizer_json = path / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise StructuredOutputError(f"{path}: no tokenizer.json, structured outputs need "
                                    "a fast tokenizer")
    eos = list(eos_token_ids) if eos_token_ids else _config_eos(path)
    tok = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size,
                                 eos_token=eos or None)
    return GrammarVocab(str(path), tok, tok.vocab_size, tuple(eos or [tok.eos_token]))


def _config_eos(path: Path) -> list[int]:
    """EOS ids as the worker reads them: generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


# ---------------------------------------------------------------------------
# spec -> grammar text -> compiled matcher


def _grammar_text(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar for a spec; raises StructuredOutputError for a
    malformed value (the cheap checks; _compile finds the rest)."""
    import llguidance

    if spec.kind not in KINDS:
        raise StructuredOutputError(f"unknown structured output kind {spec.kind!r}; "
                                    f"expected one of {', '.join(KINDS)}")
    options = _json_options(spec)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             overrides=options)
    if spec.kind == "json":
        try:
            schema = json.loads(spec.value)
        except ValueError as exc:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}",
                                        "json") from exc
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError("the JSON schema must be an object", "json")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(strict_schema(schema),
                                                                 overrides=options)
        except ValueError as exc:
            raise StructuredOutputError(f"invalid JSON schema: {exc}", "json") from exc
    if spec.kind == "regex":
        if not spec.value:
            raise StructuredOutputError("the regex is empty", "regex")
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(spec.value))
    if not spec.value.strip():
        raise StructuredOutputError("the grammar is empty", "grammar")
    try:  # Lark as llguidance takes it; GBNF (llama.cpp's EBNF) is converted
        return llguidance.grammar_from("grammar", spec.value)
    except ValueError as exc:
        raise StructuredOutputError(f"invalid grammar: {exc}", "grammar") from exc


# keywords whose value maps names to subschemas (not a schema itself)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema):
    """The schema with `"additionalProperties": false` on every object schema that
    declares properties and says nothing about others: what pydantic, LangChain and
    instructor send means "these keys", and a loose grammar lets a small model pad
    with invented keys until max_tokens (vLLM's default backend is strict too)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: strict_schema(s) for n, s in v.items()}
               if k in _SCHEMA_MAPS and isinstance(v, dict) else strict_schema(v))
           for k, v in schema.items()}
    if ("properties" in out or "patternProperties" in out) and \
            "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_options(spec: StructuredOutputSpec) -> dict:
    if spec.disable_any_whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True, "whitespace_pattern": BOUNDED_WHITESPACE}


def _choice_lark(value: str) -> str:
    try:
        choices = json.loads(value)
    except ValueError as exc:
        raise StructuredOutputError(f"choice must be a JSON array of strings: {exc}",
                                    "choice") from exc
    if not isinstance(choices, list) or not choices or \
            not all(isinstance(c, str) and c for c in choices):
        raise StructuredOutputError("choice must be a non-empty list of non-empty strings",
                                    "choice")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar and its pristine matcher: each request deep-copies it."""

    spec: StructuredOutputSpec
    matcher: object  # llguidance.LLMatcher in its start state
    compile_s: float

    def new_matcher(self):
        return self.matcher.deep_copy()


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
                 max_stuck: int = MAX_STUCK_COMPILES, stuck_after_s: float | None = None
                 ) -> None:
        self.size = size
        self.threads = threads
        self.max_stuck = max_stuck
        self._stuck_after_s = stuck_after_s  # None: the configured compile timeout
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple, _Job] = {}  # queued or running
        self._queue: deque[_Job] = deque()
        self._running: set[_Job] = set()  # counted against `threads`
        self.stuck = 0
        self.hits = 0
        self.misses = 0

    @property
    def stuck_after_s(self) -> float:
        if self._stuck_after_s is None:
            from shared import config
            self._stuck_after_s = config.structured_output_compile_timeout_s()
        return self._stuck_after_s

    def lookup(self, spec: StructuredOutputSpec, vocab: GrammarVocab) -> CompiledGrammar | None:
        """The compiled grammar when cached (counts a hit), else None (no count)."""
        key = (vocab.model_dir, vocab.vocab_size, spec.key())
        with self._lock:
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
            got = self._done.get(key)
            if got is not None:
                self._done.move_to_end(key)
                self._count(True)
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
                "simplify it", spec.kind if spec.kind in KINDS else "structured_output"
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
            compiled, error = _compile(job.spec, job.vocab), None
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


def _compile(spec: StructuredOutputSpec, vocab: GrammarVocab) -> CompiledGrammar:
    import llguidance

    start = time.perf_counter()
    grammar = _grammar_text(spec)
    matcher = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0)
    if matcher.is_error():
        field = spec.kind if spec.kind in KINDS else "structured_output"
        raise StructuredOutputError(_explain(spec, matcher.get_error()), field)
    return CompiledGrammar(spec, matcher, time.perf_counter() - start)


def _explain(spec: StructuredOutputSpec, error: str) -> str:
    what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
            "choice": "choice list", "grammar": "grammar"}[spec.kind]
    error = error.strip().splitlines()[0] if error.strip() else "rejected by the backend"
    if "nimplemented" in error or "not supported" in error:
        return f"the {what} uses a feature the backend does not support: {error}"
    return f"invalid {what}: {error}"


CACHE = CompileCache()


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


def validate_for_model(spec: StructuredOutputSpec, model_dir, vocab_size: int | None = None,
                       eos_token_ids: list[int] | None = None,
                       timeout_s: float | None = None) -> None:
    """validate() against a model's vocabulary (the frontend's door: the model
    directory it tokenizes with and the workers' vocab size and EOS ids from
    ModelInfo, so it compiles what rank 0 will compile)."""
    from shared import config
    vocab = grammar_vocab(model_dir, vocab_size, eos_token_ids)
    validate(spec, vocab, config.structured_output_compile_timeout_s()
             if timeout_s is None else timeout_s)
