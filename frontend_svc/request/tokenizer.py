"""The model's tokenizer and chat template, loaded from the checkpoint directory
(tokenizer.json, tokenizer_config.json, chat_template.jinja) with the Rust
`tokenizers` library directly: decoding runs on the per-token path, and the
frontend stays free of transformers and torch (it starts in about a second)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from shared.types import InvalidRequestError

from frontend_svc.structured.chat_template import ChatTemplate
from frontend_svc.errors import FieldError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(slots=True)
class TextTokenizer:
    fast: tokenizers.Tokenizer
    chat_template: ChatTemplate | None = None
    eos_token_id: int | None = None
    max_token_bytes: int = 0  # the longest token's text in UTF-8 bytes (bounds a prompt)
    special_tokens: dict[str, str] = field(default_factory=dict)  # for templates

    @classmethod
    def from_dir(cls, path: str | Path) -> "TextTokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (a fast tokenizer is required)")
        fast = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
        special = {k: v for k, v in special.items() if v is not None}
        source = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        if isinstance(source, list):  # named templates: use the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        eos = special.get("eos_token")
        return cls(fast, ChatTemplate(source, special) if source else None,
                   fast.token_to_id(eos) if eos else None, _max_token_bytes(fast), special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): on the frontend's
        # tokenizer threads a long prompt then leaves the event loop running
        return self.fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs report it (a partial UTF-8 byte
        shows as U+FFFD, like the reference system)."""
        return self.fast.decode([token_id], skip_special_tokens=False)

    def tokens(self, ids: list[int]) -> list[str]:
        return [self.fast.id_to_token(i) or "" for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            add_special_tokens: bool = False,
                            tools: list[dict[str, Any]] | None = None,
                            template: ChatTemplate | None = None) -> list[int]:
        """Prompt token ids for a chat; the template adds the special tokens itself
        (add_special_tokens adds the tokenizer's too, as vLLM's flag does).
        `template` overrides the model's (a tools-aware one, frontend_svc/structured/tools.py)."""
        template = template or self.chat_template
        if template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        text = template.render(messages, add_generation_prompt, continue_final_message, tools)
        try:
            return self.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # the tokenizer refuses text (a lone surrogate, ...)
            raise FieldError(f"messages cannot be tokenized: {exc}", "messages") from exc


def _max_token_bytes(fast: tokenizers.Tokenizer) -> int:
    ids = list(range(fast.get_vocab_size(with_added_tokens=True)))
    texts = fast.decode_batch([[i] for i in ids], skip_special_tokens=False)
    return max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
