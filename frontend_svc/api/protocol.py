"""Request bodies of the OpenAI-compatible HTTP API (pydantic), and REFUSED: the
one table of fields (the `openai` client's and vLLM's) this server does not
honour, each refused with a 400 naming it rather than silently ignored.
docs/api.md mirrors the table.

A field neither declared here nor in REFUSED / NO_EFFECT is ignored with one log
line, as the reference system (vLLM) does; a known field of the wrong type is a
400 (see http_util.py). Responses are plain dicts built in openai_api.py: they
are on the per-token path and need no validation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from frontend_svc.request.caps import REJECTED
from frontend_svc.errors import FieldError
from frontend_svc.telemetry.observe import log


def _given(value: Any) -> bool:
    return value is not None


def _truthy(value: Any) -> bool:
    return bool(value)


@dataclass(frozen=True, slots=True)
class Refusal:
    message: str
    refuses: Callable[[Any], bool] = _given  # the value -> is it refused?


_FUNCTIONS = Refusal("the deprecated functions / function_call are not supported: use "
                     "tools and tool_choice", _truthy)
_VLLM_ONLY = "is not supported by this server"

REFUSED: dict[str, Refusal] = {
    "suffix": Refusal("suffix (fill-in-the-middle) is not supported", _truthy),
    "prompt_logprobs": Refusal("prompt_logprobs is not supported yet"),
    # vLLM's removed guided_* fields map onto structured_outputs (structured.py); these two
    # have no counterpart there
    "guided_decoding_backend": Refusal(
        "guided_decoding_backend was removed (vLLM): the server picks the backend "
        "(llguidance); drop the field"),
    "guided_whitespace_pattern": Refusal(
        "guided_whitespace_pattern is not supported: use "
        "structured_outputs.disable_any_whitespace"),
    "functions": _FUNCTIONS,
    "function_call": Refusal(_FUNCTIONS.message, lambda v: v not in (None, "none", "auto")),
    "audio": Refusal("audio output is not supported"),
    "modalities": Refusal("only the text modality is supported",
                          lambda v: v is not None and list(v) != ["text"]),
    "prediction": Refusal("predicted outputs are not supported"),
    "web_search_options": Refusal("web search is not supported"),
    "reasoning_effort": Refusal("reasoning_effort is not supported (no reasoning models)"),
    "verbosity": Refusal("verbosity is not supported"),
    "moderation": Refusal("moderation is not supported"),
    "store": Refusal("store is not supported: completions are not stored", _truthy),
    "use_beam_search": Refusal("beam search is not supported", _truthy),
    "length_penalty": Refusal("length_penalty applies to beam search, which is not supported",
                              lambda v: v is not None and v != 1.0),
    "allowed_token_ids": Refusal(f"allowed_token_ids {_VLLM_ONLY}"),
    "bad_words": Refusal(f"bad_words {_VLLM_ONLY}", _truthy),
    "logits_processors": Refusal(f"logits_processors {_VLLM_ONLY}"),
    "prompt_embeds": Refusal(f"prompt_embeds {_VLLM_ONLY}"),
    "truncate_prompt_tokens": Refusal(f"truncate_prompt_tokens {_VLLM_ONLY}"),
    "spaces_between_special_tokens": Refusal(f"spaces_between_special_tokens=false "
                                             f"{_VLLM_ONLY}",
                                             lambda v: v is not None and v is not True),
    "return_token_ids": Refusal(f"return_token_ids {_VLLM_ONLY}", _truthy),
    "kv_transfer_params": Refusal(f"kv_transfer_params {_VLLM_ONLY}"),
    "vllm_xargs": Refusal(f"vllm_xargs {_VLLM_ONLY}"),
    "documents": Refusal(f"documents {_VLLM_ONLY}"),
    "mm_processor_kwargs": Refusal("multimodal input is not supported"),
    "media_io_kwargs": Refusal("multimodal input is not supported"),
    # OpenAI's processing tiers: there is one here (`priority` orders requests)
    "service_tier": Refusal("only the default service tier exists: use priority to order "
                            "requests", lambda v: v not in (None, "auto", "default")),
    "watermarking": Refusal(f"watermarking {_VLLM_ONLY}", _truthy),
    "truncation_side": Refusal(f"truncation_side {_VLLM_ONLY} (nor truncate_prompt_tokens, "
                               "which it applies to)"),
    "logprob_token_ids": Refusal(f"logprob_token_ids {_VLLM_ONLY}: use logprobs"),
    "repetition_detection": Refusal(f"repetition_detection {_VLLM_ONLY}"),
    "thinking_token_budget": Refusal("thinking_token_budget is not supported (no reasoning "
                                     "models)"),
    "stream_interval": Refusal(f"stream_interval other than 1 {_VLLM_ONLY}: every token is "
                               "streamed as it comes", lambda v: v is not None and v != 1),
    "return_prompt_text": Refusal(f"return_prompt_text {_VLLM_ONLY}: POST /tokenize renders "
                                  "the prompt", _truthy),
    "routed_experts_prompt_start": Refusal("routed experts are not returned (no mixture-of-"
                                           "experts models)", _truthy),
    "ec_transfer_params": Refusal(f"ec_transfer_params {_VLLM_ONLY}"),
}
# Accepted and documented (docs/api.md) as having no effect, by their own definition:
# the caller's identity and labels (user, metadata, safety_identifier, session_id),
# caching hints to OpenAI's hosted service (the prefix cache here is automatic and
# keyed by content), what vLLM itself ignores on these endpoints (return_token_offsets,
# return_mm_kwargs: its render endpoints only), and include_reasoning (no reply here
# carries reasoning, so there is none to include or leave out).
NO_EFFECT = frozenset({"user", "metadata", "safety_identifier", "session_id",
                       "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                       "return_token_offsets", "return_mm_kwargs", "include_reasoning"})
# vLLM's request_id (the body) and X-Request-Id (a header, which wins): the response
# id is cmpl- / chatcmpl- and this id, as vLLM's is, and it names the request in logs
MAX_REQUEST_ID_CHARS = 256


def check_refused(req: BaseModel) -> None:
    """A 400 naming the first given field of REFUSED whose value is refused."""
    given = req.model_fields_set
    extra = req.model_extra or {}
    for name, rule in REFUSED.items():
        if name in given:
            value = extra[name] if name in extra else getattr(req, name)
            if rule.refuses(value):
                REJECTED.labels("unsupported_field").inc()
                raise FieldError(f"{name}: {rule.message}", name)
    ignored = sorted(set(extra) - NO_EFFECT - set(REFUSED))
    if ignored:
        log.info("ignored unknown request fields", fields=ignored)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share; None means the default of SamplingParams."""

    model_config = ConfigDict(extra="allow")  # kept for check_refused, then dropped

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    best_of: int | None = None  # generate this many, return the n most likely
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: logprobs name each token "token_id:<id>" (openai_format.token_names)
    return_tokens_as_token_ids: bool = False
    user: str | None = None
    # vLLM's: the response's id (openai_api.py response_ids); bounded, it is logged
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation between tenants
    logit_bias: dict[str, float] | None = None
    # structured outputs (frontend_svc/structured/response_format.py): at most one of these
    response_format: dict[str, Any] | None = None  # OpenAI's
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    guided_json: Union[dict[str, Any], str, None] = None  # vLLM's removed fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    # Token-id lists first: a list of ints must not be read as a list of strings.
    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


# OpenAI's roles; any other is a 400 (the chat template would render it blindly).
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: ChatRole
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        # OpenAI's rule: only an assistant message (one that called tools) may omit it
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # vLLM's: the reply starts with the last message's content
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: extend the last (assistant) message
    add_special_tokens: bool = False  # vLLM's: BOS etc. on top of the template's own
    tools: list[dict[str, Any]] | None = None  # frontend_svc/structured/tools.py
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    # vLLM's: the request's own Jinja template (only with --trust-request-chat-template,
    # else vLLM's 400) and extra template variables (frontend_svc/structured/chat_template.py)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt option would change the ids

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: a prompt gets the tokenizer's special tokens, a chat only the
    # template's (as a chat completion)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # a chat is rendered exactly as a chat completion with these fields would be
    # (frontend_svc/request/translate.py chat_prompt)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # vLLM's: each id's token string too


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
