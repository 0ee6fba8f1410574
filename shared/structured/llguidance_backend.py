"""The llguidance backend (GrammarBackend, backend.py).

Why llguidance (docs/structured_outputs.md has the numbers): its wheel has no
dependencies (xgrammar's metadata pulls triton), its compile is ~5x faster at the
tail, and its mask, though slower than xgrammar's per call, is tens of microseconds
for this vocabulary, far below a step.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import llguidance

from shared.structured.backend import CompiledGrammar, GrammarVocab
from shared.structured.spec import KINDS, StructuredOutputError, StructuredOutputSpec, \
    error_field, strict_schema

# Whitespace between JSON tokens when the client does not forbid it: bounded, so a
# small model cannot pad forever ("runaway whitespace"); one newline and up to 12
# spaces or tabs per gap keeps pretty-printed JSON (indented a few levels) possible.
BOUNDED_WHITESPACE = r"\n?[ \t]{0,12}"


class LLGuidanceMatcher:
    """GrammarMatcher over an llguidance.LLMatcher."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.matcher.deep_copy())

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def fill_bitmask(self, address: int, nbytes: int) -> None:
        self.matcher.unsafe_compute_mask_ptr(address, nbytes)

    def validate(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self) -> None:
        self._vocabs: dict[tuple[str, int | None], GrammarVocab] = {}
        self._lock = threading.Lock()

    def vocab(self, model_dir, vocab_size: int | None = None,
              eos_token_ids: list[int] | None = None) -> GrammarVocab:
        """vocab_size: the model's logits width when it exceeds the tokenizer's (padded
        embeddings); eos_token_ids: the model's, else the checkpoint's config (the first
        build of a directory fixes them)."""
        path = str(Path(model_dir).resolve())
        with self._lock:  # one build a model: the tokenizer's own size and None share it
            vocab = self._vocabs.get((path, vocab_size)) or self._vocabs.get((path, None))
            if vocab is None or (vocab_size is not None and vocab.vocab_size != vocab_size):
                vocab = _build_vocab(Path(path), vocab_size, eos_token_ids)
            self._vocabs[(path, vocab_size)] = self._vocabs[(path, vocab.vocab_size)] = vocab
            if vocab_size is None:
                self._vocabs[(path, None)] = vocab
            return vocab

    def compile(self, spec: StructuredOutputSpec, vocab: GrammarVocab) -> CompiledGrammar:
        start = time.perf_counter()
        grammar = _grammar_text(spec)
        matcher = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(_explain(spec, matcher.get_error()), error_field(spec))
        return CompiledGrammar(spec, LLGuidanceMatcher(matcher), time.perf_counter() - start)


def _build_vocab(path: Path, vocab_size: int | None,
                 eos_token_ids: list[int] | None) -> GrammarVocab:
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


def _grammar_text(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar for a spec; raises StructuredOutputError for a
    malformed value (the cheap checks; _compile finds the rest)."""
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


def _explain(spec: StructuredOutputSpec, error: str) -> str:
    what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
            "choice": "choice list", "grammar": "grammar"}[spec.kind]
    error = error.strip().splitlines()[0] if error.strip() else "rejected by the backend"
    if "nimplemented" in error or "not supported" in error:
        return f"the {what} uses a feature the backend does not support: {error}"
    return f"invalid {what}: {error}"
