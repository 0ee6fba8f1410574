"""Responses API bodies as plain dicts: output items built from the chat path's
delta bodies ({"content"} / {"tool_calls"}, what the tool parsers emit), the
stream's events, and the Response object. A non-streaming response is built by
the same ResponseOutput from the whole reply, so the two agree by construction."""

from __future__ import annotations

import json
import uuid

from frontend_svc.api.responses_protocol import ResponsesRequest
from frontend_svc.request.output_stream import OutputStream


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """Output items, opened and closed as delta bodies arrive: text goes to a
    message item, each tool call to its own function_call item. feed and close
    return the stream events (without sequence_number: Sequencer adds it).

    A call is held until it is complete (the next text or call, or the end) and then
    sent whole: added, its arguments in one delta, done. A call the tool parser lists
    in `cut` (arguments that never became JSON: cut by max_output_tokens) is never
    sent nor kept, streamed or not, so a client never runs it (the response's
    status says `incomplete`)."""

    def __init__(self, cut: list[dict] = ()) -> None:
        self.items: list[dict] = []
        self._cut = cut  # the tool parser's `cut` list, which it fills as it finds them
        self._message: dict | None = None  # the message item receiving text deltas
        self._call: dict | None = None  # the call being generated, held until complete
        self._logprobs: list[dict] = []  # tokens' logprobs not yet given to a text delta

    def feed(self, bodies: list[dict], logprobs: list[dict] = ()) -> list[dict]:
        """logprobs: the output_text logprobs of the tokens these bodies came from
        (only without a tool parser: every token is then text). A token whose text
        is held back (a partial UTF-8 character) gives its logprob to the next delta."""
        self._logprobs += logprobs
        events: list[dict] = []
        for body in bodies:
            if body.get("content"):
                events += self._flush_call()
                if self._message is None:
                    events += self._open_message()
                item = self._message
                part = item["content"][0]
                part["text"] += body["content"]
                given, self._logprobs = self._logprobs, []
                part["logprobs"] += given
                events.append({"type": "response.output_text.delta", "item_id": item["id"],
                               "output_index": self.items.index(item), "content_index": 0,
                               "delta": body["content"], "logprobs": given})
            for call in body.get("tool_calls", ()):
                fn = call.get("function", {})
                if "id" in call:  # a new call: what came before it is complete
                    events += self._close_message("completed") + self._flush_call()
                    self._call = {"id": call["id"], "name": fn.get("name", ""),
                                  "arguments": ""}
                self._call["arguments"] += fn.get("arguments") or ""
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """The end of the reply: the text (its status is the response's) and the
        last call, unless it was cut."""
        return self._close_message(status) + self._flush_call()

    @property
    def text(self) -> str | None:
        texts = [c["text"] for it in self.items if it["type"] == "message" for c in it["content"]]
        return "".join(texts) or None

    @property
    def tool_calls(self) -> list[dict]:
        """The calls as a chat assistant message's tool_calls (the stored conversation)."""
        return [{"id": it["call_id"], "type": "function",
                 "function": {"name": it["name"], "arguments": it["arguments"]}}
                for it in self.items if it["type"] == "function_call"]

    def _open_message(self) -> list[dict]:
        item = {"id": new_item_id("msg"), "type": "message", "role": "assistant",
                "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [],
                             "logprobs": []}]}
        self.items.append(item)
        self._message = item
        index = len(self.items) - 1
        empty_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "content": []}},
                {"type": "response.content_part.added", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "part": empty_part}]

    def _close_message(self, status: str) -> list[dict]:
        item, self._message = self._message, None
        if item is None:
            return []
        item["status"] = status
        index = self.items.index(item)
        part = item["content"][0]
        part["logprobs"] += self._logprobs  # the last tokens' (an end-of-text token)
        self._logprobs = []
        return [{"type": "response.output_text.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "text": part["text"],
                 "logprobs": list(part["logprobs"])},
                {"type": "response.content_part.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index,
                 "item": json.loads(json.dumps(item))}]

    def _flush_call(self) -> list[dict]:
        call, self._call = self._call, None
        if call is None or any(c["id"] == call["id"] for c in self._cut):
            return []  # a cut call's arguments do not parse: never sent
        item = {"id": new_item_id("fc"), "type": "function_call", "call_id": call["id"],
                "name": call["name"], "arguments": "", "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": index,
                   "item": dict(item)}]
        item.update(arguments=call["arguments"], status="completed")
        if item["arguments"]:
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": item["id"], "output_index": index,
                           "delta": item["arguments"]})
        return events + [{"type": "response.function_call_arguments.done",
                          "item_id": item["id"], "output_index": index,
                          "name": item["name"], "arguments": item["arguments"]},
                         {"type": "response.output_item.done", "output_index": index,
                          "item": dict(item)}]


class Sequencer:
    """sequence_number on every event of one stream, from 0."""

    def __init__(self) -> None:
        self.next = 0

    def number(self, event: dict) -> dict:
        event["sequence_number"] = self.next
        self.next += 1
        return event


def usage(state: OutputStream | None) -> dict | None:
    if state is None:
        return None
    prompt = len(state.choice.prompt_token_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": state.choice.num_cached_tokens},
            "output_tokens": state.choice.num_completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + state.choice.num_completion_tokens}


def incomplete_details(finish: str | None) -> dict | None:
    """A reply cut by max_output_tokens is `incomplete` (OpenAI's status), else completed."""
    return {"reason": "max_output_tokens"} if finish == "length" else None


def response_body(resp_id: str, created: int, model: str, req: ResponsesRequest,
                  items: list[dict], status: str, finish: str | None,
                  state: OutputStream | None) -> dict:
    """The Response object; the request's settings are echoed back, as OpenAI's are."""
    return {"id": resp_id, "object": "response", "created_at": created, "model": model,
            "status": status, "error": None,
            "incomplete_details": incomplete_details(finish) if status != "in_progress"
            else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata, "output": items,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None, "store": bool(req.store),
            "temperature": req.temperature, "top_p": req.top_p,
            "top_logprobs": req.top_logprobs,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "truncation": "disabled", "user": req.user, "usage": usage(state)}
