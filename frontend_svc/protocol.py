"""Request bodies of the OpenAI-compatible HTTP API (pydantic).

Unknown fields are ignored, as OpenAI and the reference system do; a known field
of the wrong type is a 400 (see errors.py). Responses are plain dicts built in
openai_api.py: they are on the per-token path and need no validation.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share; None means the default of SamplingParams."""

    model_config = ConfigDict(extra="ignore")

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
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation between tenants
    # Accepted so that they can be refused with a clear 400 (translate.py), never
    # silently ignored.
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None


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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
