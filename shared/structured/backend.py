"""The one interface a grammar engine implements (vLLM's backend_types.py): a
backend builds a model's vocabulary once, compiles a spec into a grammar, and gives
each request a matcher that fills the token bitmask, accepts tokens, validates and
rolls back drafts, and says when the grammar is terminated. Callers (the compile
cache, the worker's GrammarState, the speculator) see only these names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.structured.spec import StructuredOutputSpec


@dataclass(frozen=True)
class GrammarVocab:
    """A backend's tokenizer info for one model (built once a model and process:
    about a second for a 49k vocabulary)."""

    model_dir: str
    tokenizer: object  # the backend's own
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False when the grammar forbids it."""

    def fill_bitmask(self, address: int, nbytes: int) -> None:
        """Write the allowed-token bitmask (one bit a token, 32 a word, little-endian
        words) at `address`."""

    def validate(self, token_ids: list[int]) -> int:
        """How many of these tokens, in order, the grammar would accept (nothing moves)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected drafts)."""

    def is_terminated(self) -> bool:
        """The grammar has ended (only EOS may follow)."""

    def error(self) -> str:
        """Why the last accept failed, in the backend's words."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar in its start state: each request gets a copy."""

    spec: StructuredOutputSpec
    start: GrammarMatcher
    compile_s: float

    def new_matcher(self) -> GrammarMatcher:
        return self.start.copy()


class GrammarBackend(Protocol):
    name: str

    def vocab(self, model_dir, vocab_size: int | None = None,
              eos_token_ids: list[int] | None = None) -> GrammarVocab:
        """The model's vocabulary, built once a process; raises StructuredOutputError."""

    def compile(self, spec: StructuredOutputSpec, vocab: GrammarVocab) -> CompiledGrammar:
        """Compile (seconds at worst, not interruptible); raises StructuredOutputError
        naming the spec part at fault."""
