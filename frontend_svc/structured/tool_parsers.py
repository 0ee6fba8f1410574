"""Tool calls out of a model's text, streamed: each parser takes the reply's text
in whatever pieces the detokenizer hands it and returns OpenAI delta bodies,
`{"content": ...}` and `{"tool_calls": [...]}`, in order. A call first appears
with its index, id, type and name (arguments ""), then as argument fragments, as
OpenAI streams them.

The one rule that keeps streaming honest: every decision depends on the
characters only, never on where a piece ended, so the concatenated deltas equal
what the same parser returns for the whole text at once (`parse_all`, the
non-streamed reply). A call whose arguments never became a whole JSON value
(cut by max_tokens, or broken after its name) is listed in `parser.cut`: the
non-streamed reply drops it, the stream names it in its final chunk. A possible
tag prefix (`<tool_`) is held back until the next piece settles it; whitespace
next to a tool call is dropped.

Parsers (vLLM's names): `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`),
`llama3_json` (the reply is `{"name", "parameters"}` objects separated by `;`),
and the two grammar-enforced shapes: `required` (a JSON array of
`{"name", "parameters"}`) and `named` (the reply is one call's arguments).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from frontend_svc.structured.json_scan import WHITESPACE, Canonicalizer, ObjectScanner, ScanError
from frontend_svc.telemetry.observe import log

ARG_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


class ToolParser:
    """Base: the output list with merging, content with whitespace rules, calls."""

    def __init__(self, new_id: Callable[[], str] = new_call_id,
                 max_calls: int | None = None) -> None:
        self.new_id = new_id
        self.max_calls = max_calls
        self.num_calls = 0
        self.cut: list[dict] = []  # {"index", "id", "name"} of calls whose arguments do not parse
        self._opened: dict[int, dict] = {}
        self._out: list[dict] = []
        self._held_ws = ""  # trailing whitespace of content: dropped if a call follows
        self._strip_leading = False  # just after a call: its following whitespace goes

    # ---- the interface

    def feed(self, text: str) -> list[dict]:
        """Delta bodies for the next piece of the reply."""
        while text:
            text = self._handle(text)
        return self._take()

    def finish(self) -> list[dict]:
        """The reply ended: what was held back, settled."""
        self._end()
        if self._held_ws:
            self._emit_content(self._held_ws)
            self._held_ws = ""
        return self._take()

    @property
    def full(self) -> bool:
        return self.max_calls is not None and self.num_calls >= self.max_calls

    # ---- for subclasses

    def _handle(self, text: str) -> str:  # consume some of text, return the rest
        raise NotImplementedError

    def _end(self) -> None:
        pass

    def _content(self, text: str) -> None:
        """Content with whitespace next to a call removed: trailing whitespace waits
        for the next non-space character (kept) or call (dropped)."""
        if self._strip_leading:
            text = text.lstrip(WHITESPACE)
            if not text:
                return
            self._strip_leading = False
        body = text.rstrip(WHITESPACE)
        if body:
            self._emit_content(self._held_ws + body)
            self._held_ws = text[len(body):]
        else:
            self._held_ws += text

    def _open_call(self, name: str) -> int:
        self._held_ws = ""
        index = self.num_calls
        self.num_calls += 1
        call_id = self.new_id()
        self._opened[index] = {"index": index, "id": call_id, "name": name}
        self._out.append({"tool_calls": [{"index": index, "id": call_id,
                                          "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})
        return index

    def _cut_call(self, index: int, why: str) -> None:
        """The call's arguments will never parse: it must not reach a client as a call."""
        if all(c["index"] != index for c in self.cut):
            self.cut.append(self._opened[index])
            log.warning("tool call cut: its arguments do not parse", parser=type(self).__name__,
                        tool=self._opened[index]["name"], why=why)

    @property
    def num_complete(self) -> int:
        return self.num_calls - len(self.cut)

    def _args(self, index: int, fragment: str) -> None:
        last = self._out[-1]["tool_calls"][0] if self._out and \
            "tool_calls" in self._out[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self._out.append({"tool_calls": [{"index": index,
                                              "function": {"arguments": fragment}}]})

    def _emit_content(self, text: str) -> None:
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out


class CallObject:
    """One `{"name": ..., "arguments"|"parameters": ...}` object being scanned: the
    call opens when its name is read; arguments read before that are buffered. The
    arguments go out re-serialized (json_scan.Canonicalizer: json.dumps of the
    parsed value, ensure_ascii=False), as vLLM's hermes parser returns them."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.index: int | None = None
        self.raw = ""  # everything fed so far (for a fallback to content)
        self._args_key: str | None = None
        self._args_buf = ""
        self._args_sent = False
        self._args_closed = False
        self._args_bad: str | None = None  # why the ended arguments are no JSON value
        self._canon = Canonicalizer()
        self.scanner = ObjectScanner(self._value, self._end)

    @property
    def committed(self) -> bool:
        return self.index is not None

    @property
    def done(self) -> bool:
        return self.scanner.done

    def feed(self, text: str) -> int:
        """Characters consumed; raises ScanError (with `.at`) on bad JSON."""
        try:
            n = self.scanner.feed(text)
        except ScanError as exc:
            self.raw += text[:exc.at]
            if self.committed:
                self.parser._cut_call(self.index, str(exc))
            raise
        self.raw += text[:n]
        if self.scanner.done:
            self.close()
        return n

    def close(self) -> None:
        """The object ended (or the reply did): a call without arguments gets {}; one
        whose object did not end is cut (no filler that would pass for arguments)."""
        if self.committed and not self.scanner.done and not self._args_closed:
            self.parser._cut_call(self.index, "the reply ended inside the call")
        elif self.committed:
            self._pass(self._canon.finish())
            if not self._args_sent:
                self._send("{}")

    def _send(self, fragment: str) -> None:
        self._args_sent = True
        self.parser._args(self.index, fragment)

    def _pass(self, fragment: str) -> None:
        if not fragment:
            return
        if self.committed:
            self._send(fragment)
        else:
            self._args_buf += fragment

    def _value(self, key: str, chars: str) -> None:
        if key not in ARG_KEYS or self._args_closed or self._args_key not in (None, key):
            return
        self._args_key = key
        self._pass(self._canon.feed(chars))

    def _end(self, key: str, raw: str) -> None:
        if key == "name" and not self.committed:
            try:
                name = json.loads(raw)
            except ValueError:  # a scalar that is no JSON value (`tru`)
                name = None
            if not isinstance(name, str) or not name:
                raise ScanError("a tool call's name must be a non-empty string")
            self.index = self.parser._open_call(name)
            if self._args_buf:
                self._send(self._args_buf)
        elif key == self._args_key:
            self._args_closed = True
            self._pass(self._canon.finish())
            try:  # the scanner matches brackets by depth only: `{"a": 1]` ends too
                json.loads(raw)
            except ValueError as exc:
                self._args_bad = f"the arguments are not valid JSON: {exc}"
        if self.committed and self._args_bad:
            self.parser._cut_call(self.index, self._args_bad)


class TagBuffer:
    """Finds a tag in text that arrives in pieces: a suffix that may start the tag
    is held back until the next piece."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.pending = ""

    def split(self, text: str) -> tuple[str, str | None]:
        """(text before the tag or safe to pass on, the rest after the tag or None)."""
        buf = self.pending + text
        at = buf.find(self.tag)
        if at >= 0:
            self.pending = ""
            return buf[:at], buf[at + len(self.tag):]
        keep = next((k for k in range(min(len(self.tag) - 1, len(buf)), 0, -1)
                     if self.tag.startswith(buf[-k:])), 0)
        self.pending = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the
    reply; the text outside the tags is content. A block whose JSON breaks before
    the call's name is known falls back to content; after that, the call stands
    and the rest of its block (up to `</tool_call>`) is dropped."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "text"
        self._tag = TagBuffer(self.OPEN)
        self._call: CallObject | None = None

    def _handle(self, text: str) -> str:
        if self.state == "text":
            before, rest = self._tag.split(text)
            self._content(before)
            if rest is None:
                return ""
            # the whitespace before the tag stays held: a call drops it (_open_call),
            # a block that falls back to content gets it back, so content stays exact
            self._call, self.state = CallObject(self), "block"
            return rest
        if self.state == "block":
            return self._block(text)
        if self.state == "close":
            return self._close_tag(text)
        return ""  # "ignore": the call limit was reached

    def _block(self, text: str) -> str:
        call = self._call
        try:
            n = call.feed(text)
        except ScanError as exc:
            rest = text[exc.at:]
            if not call.committed:
                self._fallback(call)
            else:
                self._log(exc)
                self.state, self._tag = "close", TagBuffer(self.CLOSE)
            return rest
        if call.done:
            self.state, self._tag = "close", TagBuffer(self.CLOSE)
        return text[n:]

    def _close_tag(self, text: str) -> str:
        """After a call's object, everything up to the closing tag is dropped
        (whitespace, or junk the model wrote after the JSON); so is the rest of a
        block whose JSON broke after the call opened ("skip")."""
        _, rest = self._tag.split(text)
        if rest is None:
            return ""
        self._after_call()
        return rest

    def _after_call(self) -> None:
        self._tag = TagBuffer(self.OPEN)
        self._strip_leading = True
        self.state = "ignore" if self.full else "text"

    def _fallback(self, call: CallObject) -> None:
        self.state = "text"
        self._content(self.OPEN + call.raw)

    def _log(self, exc: ScanError) -> None:
        log.warning("tool call arguments are not valid JSON", parser="hermes",
                    error=str(exc))

    def _end(self) -> None:
        if self.state == "text":
            self._content(self._tag.flush())
        elif self.state == "block":
            if self._call.committed:
                self._call.close()
            else:
                self._fallback(self._call)


class Llama3JsonParser(ToolParser):
    """Llama 3's JSON tool calls (vLLM's `llama3_json`): a reply that starts with
    `{` (or `<|python_tag|>`) is `{"name", "parameters"}` objects separated by `;`;
    any other reply is content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "lead"
        self._lead = ""
        self._call: CallObject | None = None
        self._prefix = ""  # what opened the object (the tag, `;`): content again on fallback

    def _handle(self, text: str) -> str:
        if self.state == "lead":
            return self._leading(text)
        if self.state == "json":
            return self._object(text)
        if self.state == "between":
            stripped = text.lstrip(WHITESPACE)
            if not stripped:
                return ""
            if stripped[0] == ";":
                self._call, self.state, self._prefix = CallObject(self), "json", ";"
                return stripped[1:]
            self.state, self._strip_leading = "text", True
            return stripped
        if self.state == "text":
            self._content(text)
        return ""  # "ignore"

    def _leading(self, text: str) -> str:
        self._lead += text
        head = self._lead.lstrip(WHITESPACE)
        if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
            return ""  # not settled yet
        if head.startswith(self.PYTHON_TAG) or head[0] == "{":
            rest = head[len(self.PYTHON_TAG):] if head.startswith(self.PYTHON_TAG) else head
            self._content(self._lead[:len(self._lead) - len(head)])  # held, as in hermes
            self._prefix = self.PYTHON_TAG if head.startswith(self.PYTHON_TAG) else ""
            self._call, self.state = CallObject(self), "json"
            return rest
        self.state, lead, self._lead = "text", self._lead, ""
        self._content(lead)
        return ""

    def _object(self, text: str) -> str:
        call = self._call
        try:
            n = call.feed(text)
        except ScanError as exc:
            if not call.committed:
                self.state = "text"
                self._content(self._prefix + call.raw)
            else:
                log.warning("tool call arguments are not valid JSON", parser="llama3_json",
                            error=str(exc))
                self.state = "ignore"
            return text[exc.at:]
        if call.done:
            self.state = "ignore" if self.full else "between"
        return text[n:]

    def _end(self) -> None:
        if self.state == "lead" and self._lead:
            self._content(self._lead)
        elif self.state == "json":
            if self._call.committed:
                self._call.close()
            else:
                self._content(self._prefix + self._call.raw)


class RequiredParser(ToolParser):
    """tool_choice "required": the grammar makes the reply a JSON array of
    `{"name": ..., "parameters": {...}}` (vLLM's schema); no content."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "start"
        self._call: CallObject | None = None

    def _handle(self, text: str) -> str:
        if self.state == "object":
            return self._object(text)
        stripped = text.lstrip(WHITESPACE)
        if not stripped or self.state == "ignore":
            return ""
        ch = stripped[0]
        if self.state == "start" and ch == "[":
            self.state = "element"
        elif self.state == "element" and ch == "{":
            self._call, self.state = CallObject(self), "object"
            return stripped
        elif self.state == "after" and ch in ",]":
            self.state = "element" if ch == "," else "ignore"
        else:
            self._broken(f"unexpected {ch!r} in the tool-call array")
        return stripped[1:]

    def _object(self, text: str) -> str:
        try:
            n = self._call.feed(text)
        except ScanError as exc:
            self._broken(str(exc))
            return ""
        if self._call.done:
            self.state = "ignore" if self.full else "after"
        return text[n:]

    def _broken(self, why: str) -> None:
        log.warning("the tool-call array is not valid JSON", parser="required", error=why)
        self.state = "ignore"

    def _end(self) -> None:
        if self.state == "object":
            self._call.close()


class NamedParser(ToolParser):
    """A named tool_choice: the grammar makes the whole reply that function's
    arguments; the call opens before the first fragment."""

    def __init__(self, name: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.name = name
        self._index: int | None = None
        self._started = False
        self._text = ""  # the arguments so far: whole JSON at the end, or the call is cut

    def _open(self) -> None:
        if self._index is None:
            self._index = self._open_call(self.name)

    def _handle(self, text: str) -> str:
        self._open()
        self._text += text
        if not self._started:
            text = text.lstrip(WHITESPACE)
            self._started = bool(text)
        body = text.rstrip(WHITESPACE)
        if body:
            self._args(self._index, self._held_ws + body)
            self._held_ws = text[len(body):]
        else:
            self._held_ws += text
        return ""

    def finish(self) -> list[dict]:
        self._open()
        self._held_ws = ""  # trailing whitespace is not part of the arguments
        try:
            json.loads(self._text)
        except ValueError:
            self._cut_call(self._index, "the arguments are not a whole JSON value")
        return self._take()


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser,
                                        "llama3_json": Llama3JsonParser}


def parse_all(parser: ToolParser, text: str) -> tuple[str | None, list[dict]]:
    """The whole reply at once: (content or None, OpenAI tool_calls without the cut
    ones: never a call whose arguments do not parse)."""
    content, calls = collect(parser.feed(text) + parser.finish())
    cut = {c["id"] for c in parser.cut}
    return content, [c for c in calls if c["id"] not in cut]


def collect(bodies: list[dict]) -> tuple[str | None, list[dict]]:
    """Delta bodies folded into a message's content and tool_calls, as a client
    that concatenates a stream would."""
    content: list[str] = []
    calls: dict[int, dict] = {}
    for body in bodies:
        if "content" in body:
            content.append(body["content"])
        for delta in body.get("tool_calls", ()):
            call = calls.setdefault(delta["index"], {"id": None, "type": "function",
                                                     "function": {"name": "",
                                                                  "arguments": ""}})
            call["id"] = delta.get("id", call["id"])
            fn = delta.get("function", {})
            call["function"]["name"] += fn.get("name", "")
            call["function"]["arguments"] += fn.get("arguments", "")
    return ("".join(content) or None), [calls[i] for i in sorted(calls)]
