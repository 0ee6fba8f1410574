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

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Histogram

# Per process: the frontend's validation and rank 0's compiles each count their own.
COMPILE_TIME = Histogram("gapserve:structured_output_compile_seconds",
                         "Time to compile one structured-output grammar (a cache miss).",
                         ["kind"], buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                            0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
CACHE_LOOKUPS = Counter("gapserve:structured_output_cache",
                        "Compiled-grammar cache lookups, by result (hit, miss).", ["result"])

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# Seconds a compile may take before the request is refused (the frontend's and the
# worker's); shared.config's --structured-output-compile-timeout overrides it.
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# How many compiled grammars stay cached (per process): a compiled matcher is a few
# hundred KB for a nested schema; 256 is a few tens of MB at most.
CACHE_SIZE = 256
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
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
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


class CompileCache:
    """Compiled grammars by (vocab, spec), LRU, thread-safe; a spec compiled by a
    concurrent caller is awaited rather than compiled twice. Counts hits and misses
    (gapserve:structured_output_cache_total{result}) and times compiles."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple, object] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self.hits = 0
        self.misses = 0

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
        compile runs on the cache's threads (joined by concurrent askers)."""
        key = (vocab.model_dir, vocab.vocab_size, spec.key())
        with self._lock:
            got = self._done.get(key)
            if got is not None:
                self._done.move_to_end(key)
                self._count(True)
                future: Future = Future()
                future.set_result(got)
                return future
            self._count(False)
            future = self._pending.get(key)
            if future is None:
                future = self._pool.submit(self._compile_and_store, key, spec, vocab)
                self._pending[key] = future
            return future

    def compile(self, spec: StructuredOutputSpec, vocab: GrammarVocab,
                timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """The compiled grammar, compiling it (off the caller's thread, bounded by
        timeout_s) on a miss; raises StructuredOutputError."""
        future = self.submit(spec, vocab)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
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

    def _compile_and_store(self, key: tuple, spec: StructuredOutputSpec,
                           vocab: GrammarVocab) -> CompiledGrammar:
        try:
            compiled = _compile(spec, vocab)
        finally:
            with self._lock:
                self._pending.pop(key, None)
        with self._lock:
            self._done[key] = compiled
            while len(self._done) > self.size:
                self._done.popitem(last=False)
        COMPILE_TIME.labels(spec.kind).observe(compiled.compile_s)
        return compiled


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
             timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
    """Compile the spec (through the cache) with a timeout; raise
    StructuredOutputError naming the problem. Changes nothing else."""
    CACHE.compile(spec, vocab, timeout_s)


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
