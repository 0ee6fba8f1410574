"""OpenAI response bodies as plain dicts: choices, logprobs, usage, SSE chunks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from shared.types import TokenLogprobs

from frontend_svc.request.output_stream import Delta, OutputStream
from frontend_svc.request.tokenizer import TextTokenizer
from frontend_svc.structured.tool_parsers import parse_all

MIN_LOGPROB = -9999.0  # JSON has no -Infinity


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def sse(body: dict | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_of(prompt_lens: list[int], states: list[OutputStream]) -> dict:
    """Prompt tokens count once per prompt (its n choices share it), like the
    reference; completion tokens sum over all choices."""
    out = usage(sum(prompt_lens), sum(s.choice.num_completion_tokens for s in states))
    # OpenAI's prompt_tokens_details.cached_tokens: per prompt, the fewest any of its
    # choices found cached (choice k of a response is `<id>-k`, of prompt k // n)
    n = max(1, len(states) // max(1, len(prompt_lens)))
    per_prompt: dict[int, int] = {}
    for s in states:
        tail = s.choice.req_id.rsplit("-", 1)[-1]
        k = int(tail) if tail.isdigit() else 0
        cached = s.choice.num_cached_tokens
        per_prompt[k // n] = min(per_prompt.get(k // n, cached), cached)
    out["prompt_tokens_details"] = {"cached_tokens": sum(per_prompt.values())}
    return out


def token_names(tokenizer: TextTokenizer, as_ids: bool = False) -> Callable[[int], str]:
    """How logprobs name a token: its text, or with vLLM's `return_tokens_as_token_ids`
    "token_id:<id>" (a token whose text is ambiguous or a partial UTF-8 sequence stays
    identifiable)."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else tokenizer.token_text


class CompletionLogprobs:
    """The legacy completions logprobs object, built token by token; text_offset
    keeps counting across stream chunks (offsets into the text, whatever names the
    tokens carry)."""

    __slots__ = ("tokenizer", "offset", "as_ids")

    def __init__(self, tokenizer: TextTokenizer, offset: int = 0,
                 as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.offset = offset
        self.as_ids = as_ids

    def format(self, lps: list[TokenLogprobs]) -> dict:
        name = token_names(self.tokenizer, self.as_ids)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            text = self.tokenizer.token_text(lp.token_id)
            token = name(lp.token_id) if self.as_ids else text
            out["tokens"].append(token)
            out["token_logprobs"].append(_lp(lp.logprob))
            top = {name(i): _lp(p) for i, p in lp.top}
            top.setdefault(token, _lp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(tokenizer: TextTokenizer, lps: list[TokenLogprobs],
                  as_ids: bool = False) -> dict:
    name = token_names(tokenizer, as_ids)

    def entry(token_id: int, logprob: float) -> dict:
        token = name(token_id)
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, p) for i, p in lp.top]} for lp in lps]}


def completion_choice(index: int, state: OutputStream, echo_text: str | None,
                      logprobs: dict | None) -> dict:
    return {"index": index, "text": (echo_text or "") + state.text, "logprobs": logprobs,
            "finish_reason": _finish(state.choice.finish_reason),
            "stop_reason": state.choice.stop_reason}


def best_of(states: list[OutputStream], width: int, n: int) -> list[int]:
    """Indexes of the n most likely of each prompt's `width` candidates, highest
    cumulative logprob first (vLLM's best_of); all of them, in order, if width == n."""
    if width == n:
        return list(range(len(states)))
    keep: list[int] = []
    for start in range(0, len(states), width):
        group = range(start, start + width)
        keep += sorted(group, key=lambda i: -sum(
            lp.logprob for lp in states[i].choice.output_logprobs))[:n]
    return keep


def chat_choice(index: int, state: OutputStream, echo_text: str | None,
                logprobs: dict | None, plan=None) -> dict:
    """One chat choice; with a tool plan that parses (auto, required, named), the
    reply is split into content (None if empty) and tool_calls by its parser."""
    message = {"role": "assistant", "content": (echo_text or "") + state.text}
    finish = _finish(state.choice.finish_reason)
    if plan is not None and plan.parses:
        parser = plan.new_parser()
        content, calls = parse_all(parser, state.text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        finish = plan.finish_reason(finish, len(calls), bool(parser.cut))
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish, "stop_reason": state.choice.stop_reason}


def completion_chunk(resp_id: str, created: int, model: str, index: int, text: str,
                     delta: Delta | None, logprobs: dict | None) -> dict:
    return {"id": resp_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": delta.finish_name if delta else None,
                         "stop_reason": delta.stop_reason if delta else None}]}


def chat_chunk(resp_id: str, created: int, model: str, index: int, delta_body: dict,
               delta: Delta | None, logprobs: dict | None,
               finish_reason: str | None = None, cut: list[dict] | None = None) -> dict:
    """finish_reason: given when tool calling renames it (ToolPlan.finish_reason);
    cut: the final chunk's `cut_tool_calls`, the streamed calls whose arguments do
    not parse (docs/tool_calling.md)."""
    finish = finish_reason or (delta.finish_name if delta else None)
    choice = {"index": index, "delta": delta_body, "logprobs": logprobs,
              "finish_reason": finish, "stop_reason": delta.stop_reason if delta else None}
    if cut:
        choice["cut_tool_calls"] = cut
    return {"id": resp_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [choice]}


def _finish(reason) -> str | None:
    return {1: "stop", 2: "length", 3: "abort"}.get(int(reason)) if reason else None


def now() -> int:
    return int(time.time())
