"""The model's tokenizer and chat template, loaded from the checkpoint directory.

Encoding and chat templates go through transformers; decoding goes straight to the
Rust `tokenizers` object because it runs on the per-token path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shared.types import InvalidRequestError


@dataclass(slots=True)
class TextTokenizer:
    hf: PreTrainedTokenizerBase
    fast: tokenizers.Tokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> "TextTokenizer":
        hf = AutoTokenizer.from_pretrained(str(path))
        fast = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
        if fast is None:
            raise RuntimeError(f"{path}: a fast tokenizer (tokenizer.json) is required")
        return cls(hf=hf, fast=fast)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs report it (a partial UTF-8 byte
        shows as U+FFFD, like the reference system)."""
        return self.fast.decode([token_id], skip_special_tokens=False)

    def tokens(self, ids: list[int]) -> list[str]:
        return [self.fast.id_to_token(i) or "" for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids for a chat; the template adds the special tokens itself."""
        if not self.hf.chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        try:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template may raise on roles it does not support
            raise InvalidRequestError(f"chat template failed on these messages: {exc}") from exc
        return self.encode(text, add_special_tokens=False)
