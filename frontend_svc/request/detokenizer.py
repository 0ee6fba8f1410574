"""Incremental detokenization: text for each new token without re-decoding the
whole output.

Byte-level BPE splits one character (an emoji, a CJK ideograph) over several
tokens; decoding a token alone then yields U+FFFD. We decode a small sliding window
instead: `prefix` = tokens already emitted that give the new ones their context
(SentencePiece drops a leading space at the start of a decode), `read` = where the
not-yet-emitted tokens start. Text is emitted only when the window no longer ends in
an incomplete character, so the concatenated deltas equal one decode of all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tokenizers

REPLACEMENT = "\ufffd"
# A UTF-8 character has at most 4 bytes; waiting for more tokens cannot fix it.
MAX_PENDING_TOKENS = 4
# Prompt tokens kept as left context for the first output token.
PROMPT_CONTEXT_TOKENS = 5


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: tokenizers.Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)  # context + output tokens
    prefix_offset: int = 0
    read_offset: int = 0

    @classmethod
    def for_prompt(cls, tokenizer: tokenizers.Tokenizer, prompt_ids: list[int],
                   skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        return cls(tokenizer, skip_special_tokens, context, 0, len(context))

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end],
                                     skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character
        is still incomplete)."""
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        if self.read_offset == len(self.ids):
            return ""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        pending = len(self.ids) - self.read_offset
        if not final and new_text.endswith(REPLACEMENT) and pending < MAX_PENDING_TOKENS:
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta
