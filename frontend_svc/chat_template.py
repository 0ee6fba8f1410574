"""The model's chat template, rendered the way Hugging Face transformers renders
it (a sandboxed Jinja2 environment with trim_blocks/lstrip_blocks and the same
helpers), without importing transformers (and with it torch) into the frontend."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from frontend_svc.errors import FieldError


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    __slots__ = ("template", "special_tokens", "source", "origin")

    def __init__(self, source: str, special_tokens: dict[str, str],
                 origin: str = "the model's") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.template = env.from_string(source)
        self.special_tokens = special_tokens  # bos_token, eos_token, ...: templates use them
        self.source = source
        self.origin = origin  # for logs and errors: the model's, --chat-template's, ...

    @property
    def renders_tools(self) -> bool:
        """Whether the template reads `tools` at all (SmolLM2's does not)."""
        return "tools" in self.source

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        try:  # tools=None like transformers, which always passes the variable
            text = self.template.render(messages=messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except (TemplateError, TypeError, ValueError, KeyError) as exc:
            # e.g. a template that refuses a role order, or trips on a message's shape
            raise FieldError(f"the chat template refused these messages: {exc}",
                             "messages") from exc
        return _continued(text, messages[-1]["content"]) if continue_final_message else text


def _continued(text: str, final: str) -> str:
    """The rendering cut right after the last message's content, so generation
    continues it (transformers' continue_final_message, whose rule this copies:
    a template may strip the message's trailing whitespace)."""
    stripped = final.strip()
    if not stripped or stripped not in text:
        raise FieldError("continue_final_message: the last message's content does not "
                         "appear in the chat template's rendering", "continue_final_message")
    at = text.rindex(stripped)
    if text[at:at + len(final.lstrip())] == final.lstrip():
        return text[:at + len(final.lstrip())]
    return text[:at + len(stripped)]
