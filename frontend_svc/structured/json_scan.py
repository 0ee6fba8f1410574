"""An incremental scanner of one JSON object, character by character, for the
tool-call parsers: it reports each top-level key's raw value text as it arrives,
so a tool call's `arguments` can stream while the model writes them.

Why not json.loads on every delta: the text arrives in arbitrary pieces, and the
parsers must give the same answer whatever the pieces are (the concatenated
stream equals the non-streamed reply). A character-level state machine depends
only on the characters, never on where a delta boundary fell.
"""

from __future__ import annotations

import json
from collections.abc import Callable

WHITESPACE = " \t\n\r"
_OPEN = "{["
_CLOSE = "}]"


class ScanError(ValueError):
    """The text is not one JSON object; `at`: how many characters of the piece
    being fed were consumed before it went wrong (the offending one is not)."""

    at: int = 0


class ObjectScanner:
    """Feed characters of `{"key": value, ...}`; `on_value(key, chars)` gets the
    raw characters of each top-level value as they come (several calls per value),
    `on_end(key, raw)` the whole raw value when it ends. `done` once the closing
    brace is read; `feed` returns how many characters it consumed (the rest of a
    piece belongs to whatever follows the object)."""

    def __init__(self, on_value: Callable[[str, str], None] | None = None,
                 on_end: Callable[[str, str], None] | None = None) -> None:
        self.on_value = on_value or (lambda key, chars: None)
        self.on_end = on_end or (lambda key, raw: None)
        self.state = "start"
        self.done = False
        self._key = ""  # the raw key being read (escapes kept), then decoded
        self._raw = ""  # the raw value being read
        self._depth = 0  # nesting inside the value
        self._in_string = False
        self._escape = False
        self._scalar = False
        self._cursor = 0

    def feed(self, text: str) -> int:
        """Consume characters until the object ends; raises ScanError on bad JSON."""
        i = 0
        try:
            while i < len(text) and not self.done:
                self._cursor = i
                if self.state == "value":
                    i = self._value_run(text, i)
                    continue
                if self.state == "value_start" and text[i] not in WHITESPACE:
                    self._start_value(text[i])  # the character is the value's first
                    continue
                self._step(text[i])
                i += 1
        except ScanError as exc:
            exc.at = self._cursor  # where in this piece the object went wrong
            raise
        return i

    def _step(self, ch: str) -> None:
        state = self.state
        if state == "key":
            self._key_char(ch)
        elif ch in WHITESPACE:
            return
        elif state == "start":
            self._expect(ch, "{", "key_or_end")
        elif state in ("key_or_end", "key_next"):
            if ch == "}" and state == "key_or_end":
                self.done = True
            else:
                self._expect(ch, '"', "key")
                self._key = ""
        elif state == "colon":
            self._expect(ch, ":", "value_start")
        elif state == "comma_or_end":
            if ch == "}":
                self.done = True
            else:
                self._expect(ch, ",", "key_next")
        else:  # pragma: no cover - every state is handled above
            raise ScanError(f"scanner in unknown state {state}")

    def _expect(self, ch: str, want: str, then: str) -> None:
        if ch != want:
            raise ScanError(f"expected {want!r}, got {ch!r}")
        self.state = then

    def _key_char(self, ch: str) -> None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            try:
                self._key = json.loads(f'"{self._key}"')
            except ValueError:
                raise ScanError(f"bad escape in the key {self._key!r}") from None
            self.state = "colon"
            return
        self._key += ch

    def _start_value(self, ch: str) -> None:
        self.state, self._raw, self._depth = "value", "", 0
        self._in_string = self._escape = False
        self._scalar = ch not in _OPEN and ch != '"'
        if ch in _CLOSE or ch in ",:":
            raise ScanError(f"a value cannot start with {ch!r}")

    def _value_run(self, text: str, i: int) -> int:
        """Consume value characters from text[i:]; reports them in one piece."""
        start, ended = i, False
        while i < len(text) and not ended:
            if self._scalar and text[i] in WHITESPACE + ",}":
                ended = True  # the delimiter is read by the next state
                break
            ended = self._value_char(text[i])
            i += 1
        piece = text[start:i]
        self._cursor = i  # characters of this piece consumed when a callback raises
        if piece:
            self.on_value(self._key, piece)
        if ended:
            self._end_value()
        return i

    def _value_char(self, ch: str) -> bool:
        """Add one character to the value; True when it ends the value."""
        self._raw += ch
        if self._scalar:
            return False
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                return self._depth == 0
            return False
        if ch == '"':
            self._in_string = True
        elif ch in _OPEN:
            self._depth += 1
        elif ch in _CLOSE:
            self._depth -= 1
            return self._depth == 0
        return False

    def _end_value(self) -> None:
        self.state = "comma_or_end"
        self.on_end(self._key, self._raw)


# json.dumps(..., ensure_ascii=False)'s escapes: these characters and no others
_DUMPS_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n",
                  "\r": "\\r", "\t": "\\t"}
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                   "r": "\r", "t": "\t"}


def _dumps_char(ch: str) -> str:
    if ch in _DUMPS_ESCAPES:
        return _DUMPS_ESCAPES[ch]
    return f"\\u{ord(ch):04x}" if ch < " " else ch


class Canonicalizer:
    """One JSON value's text in, `json.dumps(json.loads(text), ensure_ascii=False)`
    out, incrementally: what vLLM's hermes parser returns as a call's `arguments`
    (it re-serializes the model's JSON). Fed in pieces, it gives the same characters
    whatever the pieces, so a stream and its non-streamed reply agree. Strings pass
    through as they are decoded (re-escaped the way json.dumps escapes); a number or
    literal waits for the character after it. Duplicate keys are kept (json.loads
    keeps the last one only), the one case where the two differ."""

    def __init__(self) -> None:
        self._string = False
        self._escape = ""  # an escape being read: "\\", "\\u00", ...
        self._high = ""  # a high surrogate waiting for its low half
        self._scalar = ""  # a number or literal being read

    def feed(self, text: str) -> str:
        return "".join(self._char(ch) for ch in text)

    def finish(self) -> str:
        """The value ended (or the reply did): what is still held, settled."""
        out = self._end_scalar() + self._high + self._escape
        self._high = self._escape = ""
        return out

    def _char(self, ch: str) -> str:
        if self._string:
            return self._string_char(ch)
        if ch in WHITESPACE + ',:{}[]"':
            out = self._end_scalar()
            if ch == '"':
                self._string = True
                return out + '"'
            return out + {",": ", ", ":": ": "}.get(ch, "" if ch in WHITESPACE else ch)
        self._scalar += ch
        return ""

    def _end_scalar(self) -> str:
        raw, self._scalar = self._scalar, ""
        if not raw:
            return ""
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False)
        except ValueError:  # not JSON: passed on as written (the call is broken anyway)
            return raw

    def _string_char(self, ch: str) -> str:
        if self._escape:
            return self._escaped(self._escape + ch)
        if ch == "\\":
            self._escape = ch
            return ""
        out, self._high = self._high, ""
        if ch == '"':
            self._string = False
            return out + '"'
        return out + _dumps_char(ch)

    def _escaped(self, esc: str) -> str:
        """An escape sequence so far (`\\n`, `\\u00e9`): the decoded character,
        re-escaped, once it is complete."""
        if esc[1] != "u":
            self._escape = ""
            out, self._high = self._high, ""
            return out + _dumps_char(_SIMPLE_ESCAPES.get(esc[1], esc[1]))
        if len(esc) < 6:
            self._escape = esc
            return ""
        self._escape = ""
        try:
            code = int(esc[2:], 16)
        except ValueError:
            out, self._high = self._high + esc, ""
            return out
        if self._high and 0xDC00 <= code <= 0xDFFF:  # json.loads joins the pair
            pair = (ord(self._high) - 0xD800) * 0x400 + (code - 0xDC00) + 0x10000
            self._high = ""
            return chr(pair)
        out, self._high = self._high, ""
        if 0xD800 <= code <= 0xDBFF:
            self._high = chr(code)
            return out
        return out + _dumps_char(chr(code))
