"""The model's chat template, rendered the way Hugging Face transformers renders
it (a sandboxed Jinja2 environment with trim_blocks/lstrip_blocks and the same
helpers), without importing transformers (and with it torch) into the frontend."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from frontend_svc.request.caps import REJECTED
from frontend_svc.errors import FieldError
from frontend_svc.telemetry.observe import log


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    __slots__ = ("template", "special_tokens", "source", "origin", "kwargs")

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
        self.kwargs: dict[str, Any] = {}  # a request's chat_template_kwargs

    def with_kwargs(self, kwargs: dict[str, Any]) -> "ChatTemplate":
        """This template with a request's chat_template_kwargs as extra variables
        (the compiled template is shared, not rebuilt)."""
        bound = object.__new__(ChatTemplate)
        for name in ("template", "special_tokens", "source", "origin"):
            setattr(bound, name, getattr(self, name))
        bound.kwargs = kwargs
        return bound

    @property
    def renders_tools(self) -> bool:
        """Whether the template reads `tools` at all (SmolLM2's does not)."""
        return "tools" in self.source

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        try:  # tools=None like transformers, which always passes the variable
            # transformers' order: the special tokens, then the caller's kwargs over them
            text = self.template.render(messages=messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        **{**self.special_tokens, **self.kwargs})
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


# vLLM's words (serving_engine._validate_chat_template), so a client sees the same reason
UNTRUSTED = ("Chat template is passed with request, but --trust-request-chat-template is "
             "not set. Refused request with untrusted chat template.")
# the variables the server sets itself: a request's kwargs may not replace them
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt",
                             "continue_final_message", "documents"})


@functools.lru_cache(maxsize=32)
def _compiled(source: str, special_tokens: tuple) -> ChatTemplate:
    template = ChatTemplate(source, dict(special_tokens), "the request's chat_template")
    log.info("request chat template compiled", chars=len(source),  # once per distinct one
             renders_tools=template.renders_tools)
    return template


def request_template(source: Any, kwargs: Any, trusted: bool,
                     special_tokens: dict[str, str]) -> tuple[ChatTemplate | None, dict]:
    """A chat request's own template (`chat_template`, or vLLM's
    `chat_template_kwargs.chat_template`), compiled once per distinct source and
    only under --trust-request-chat-template, and its other kwargs; FieldError
    (400) otherwise."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise FieldError("chat_template_kwargs must be an object", "chat_template_kwargs")
    kwargs = dict(kwargs or {})
    param = "chat_template" if source is not None else "chat_template_kwargs.chat_template"
    source = source if source is not None else kwargs.get("chat_template")
    kwargs.pop("chat_template", None)
    reserved = sorted(RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise FieldError(f"chat_template_kwargs.{reserved[0]}: set by the server from the "
                         "request's own fields; it cannot be a template kwarg",
                         f"chat_template_kwargs.{reserved[0]}")
    if source is None:
        return None, kwargs
    if not trusted:
        REJECTED.labels("untrusted_chat_template").inc()
        raise FieldError(UNTRUSTED, param)
    if not isinstance(source, str):
        raise FieldError("chat_template must be a string (a Jinja template)", param)
    try:
        return _compiled(source, tuple(sorted(special_tokens.items()))), kwargs
    except TemplateError as exc:  # a syntax error: said before anything is rendered
        raise FieldError(f"chat_template does not compile: {exc}", param) from exc
