"""The sure part of a JSON value whose text is still being written: how a streamed tool call's arguments go out
piece by piece (launch/frontend/call_stream.py) while adding up to the unstreamed answer's.

`JsonPrefix` reads one value's text as it comes and returns, each time, the text that is sure to extend what it
returned before, if the value goes on to be valid JSON:
- canonical (the default): the value as `json.dumps(json.loads(text), ensure_ascii=False)` writes it (with
  `ascii`, as `json.dumps(json.loads(text))` does: harmony's), the form vLLM's parsers answer arguments in:
  ", " and ": " between items, strings escaped as json.dumps escapes them, each number as json.dumps writes
  what json.loads reads (so a number goes out once it has ended);
- raw: the value as written, from its first character (whitespace after a token held until more follows).
`done` once the value is whole, and `end`: how many of the characters fed it took (what follows is not the
value's). It stops (`failed`, and returns nothing more) where the text cannot dump back to what it returned
and what follows: not JSON, a repeated key (json.loads keeps the last value, in the first key's place), a lone
surrogate without `ascii` (the unstreamed answer then escapes all non-ASCII), or a top-level value not opening
with one of `opens`. Each character is read once (a string's plain characters in runs), and only a string's
text since the last piece is kept (a key's until it ends).
"""
from __future__ import annotations

import json
import re

_SPACE = " \t\n\r"              # JSON's whitespace
_NOT_SCALAR = _SPACE + ',:[]{}"'  # what ends a number or literal
_HEX = set("0123456789abcdefABCDEF")
_RUN = re.compile(r'[^"\\]+')         # a run of a string's characters that neither end it nor escape


class JsonPrefix:
    """One value's text, fed piece by piece (module docstring). `opens`: the characters the value may begin with
    (None: any)."""

    def __init__(self, canonical: bool = True, opens: str | None = None, ascii: bool = False):
        self.canonical, self.opens, self.ascii = canonical, opens, ascii
        self.stack: list[set[str] | None] = []     # open containers: an object's keys so far, None for an array
        self.expect = "value"       # value | item (value or "]") | key | member (key or "}") | colon | next | -
        self.done = self.failed = False
        self.end = 0
        self._fed = 0               # characters fed so far
        self._string: str | None = None     # "key" or "value" inside a string
        self._token = ""            # the string's raw text not yet decoded, or the number or literal so far
        self._escaped = False       # the string's last character was an unpaired backslash
        self._held = ""             # raw: whitespace not yet sent

    def feed(self, text: str) -> str:
        """The sure text that `text`, the next characters of the value (and maybe of what follows it), adds."""
        out: list[str] = []
        i = 0
        while i < len(text) and not (self.done or self.failed):
            if self._string is not None and not self._escaped and (run := _RUN.match(text, i)):
                self._run(run.group(), out)     # a string's plain characters, in one go
                i = run.end()
                continue
            self._char(text[i], out)
            if self.done:
                self.end = self._fed + i + (0 if self._ended_by_next else 1)
            i += 1
        self._fed += len(text)
        if self._string == "value" and not self.failed and self.canonical:
            self._flush_string(out, final=False)
        return "" if self.failed else "".join(out)

    _ended_by_next = False      # a number or literal ends at the character after it, which is not the value's

    def _fail(self) -> None:
        self.failed = True

    def _emit(self, out: list[str], canonical: str, raw: str) -> None:
        if self.canonical:
            out.append(canonical)
        else:
            out.append(self._held + raw)
            self._held = ""

    def _char(self, c: str, out: list[str]) -> None:
        if self._string is not None:
            return self._in_string(c, out)
        if self._token:             # a number or literal
            if c not in _NOT_SCALAR:
                self._token += c
                if not self.canonical:
                    self._emit(out, "", c)
                return
            if not self._scalar(out):
                return
            if self.done:
                self._ended_by_next = True
                return
        if c in _SPACE:
            if not self.canonical and self.stack:
                self._held += c
            return
        if self.expect in ("value", "item"):
            if self.opens is not None and not self.stack and c not in self.opens:
                return self._fail()
            if c == "]" and self.expect == "item":
                return self._close(c, out)
            if c in "{[":
                self.stack.append(set() if c == "{" else None)
                self.expect = "member" if c == "{" else "item"
                return self._emit(out, c, c)
            if c == '"':
                self._string, self._token = "value", ""
                return self._emit(out, c, c)
            if c in _NOT_SCALAR:
                return self._fail()
            self._token = c
            if not self.canonical:
                self._emit(out, "", c)
        elif self.expect in ("key", "member"):
            if c == "}" and self.expect == "member":
                return self._close(c, out)
            if c != '"':
                return self._fail()
            self._string, self._token = "key", ""
        elif self.expect == "colon":
            if c != ":":
                return self._fail()
            self.expect = "value"
            self._emit(out, ": ", c)
        elif self.expect == "next":
            if c == ",":
                self.expect = "key" if self.stack[-1] is not None else "value"
                return self._emit(out, ", ", c)
            if c in "]}" and (c == "}") == (self.stack[-1] is not None):
                return self._close(c, out)
            self._fail()
        else:
            self._fail()

    def _close(self, c: str, out: list[str]) -> None:
        self.stack.pop()
        self._emit(out, c, c)
        self._after_value()

    def _after_value(self) -> None:
        self.expect = "next" if self.stack else "-"
        self.done = not self.stack

    def _scalar(self, out: list[str]) -> bool:
        """The number or literal just ended: out its canonical form; False when it is none."""
        token, self._token = self._token, ""
        try:
            value = json.loads(token)
        except (ValueError, RecursionError):
            self._fail()
            return False
        if self.canonical:
            out.append(json.dumps(value))
        self._after_value()
        return True

    def _in_string(self, c: str, out: list[str]) -> None:
        if c == '"' and not self._escaped:
            kind = self._string
            if kind == "key":
                self._key(out)
            elif self.canonical:
                self._flush_string(out, final=True)
            if self.failed:
                return
            self._string, self._token = None, ""
            self._emit(out, "" if kind == "key" else '"', c)
            if kind == "key":
                self.expect = "colon"
            else:
                self._after_value()
            return
        self._escaped = c == "\\" and not self._escaped
        self._run(c, out)

    def _run(self, text: str, out: list[str]) -> None:
        """Characters inside a string: kept to decode (canonical, or a key), or sent as written (raw)."""
        if not self.canonical and self._string == "value":
            self._emit(out, "", text)
        else:
            self._token += text

    def _key(self, out: list[str]) -> None:
        if not self.canonical:      # the text as written: a repeated key or a lone surrogate stays as it is
            return self._emit(out, "", '"' + self._token)
        key = self._decode(self._token)
        if key is None or key in self.stack[-1]:
            return self._fail()
        self.stack[-1].add(key)
        out.append(json.dumps(key, ensure_ascii=self.ascii))

    def _flush_string(self, out: list[str], final: bool) -> None:
        """Out the canonical form of the string's raw text so far, up to an escape not yet whole (or a high
        surrogate's escape that the next one may pair with)."""
        raw = self._token
        cut = len(raw) if final else _safe_cut(raw)
        text = self._decode(raw[:cut])
        if text is None:
            return self._fail()
        out.append(json.dumps(text, ensure_ascii=self.ascii)[1:-1])
        self._token = raw[cut:]

    def _decode(self, raw: str) -> str | None:
        try:
            text = json.loads('"' + raw + '"')
        except ValueError:
            return None
        return None if not self.ascii and any("\ud800" <= ch <= "\udfff" for ch in text) else text


def _safe_cut(raw: str) -> int:
    """How much of a string's raw text decodes the same whatever follows: all but an escape cut short, or a high
    surrogate's \\u escape that the next characters may still pair with."""
    i = 0
    while i < len(raw):
        if raw[i] != "\\":
            i += 1
            continue
        if i + 1 >= len(raw):
            return i
        if raw[i + 1] != "u":
            i += 2
            continue
        if i + 6 > len(raw):
            return i
        code = raw[i + 2:i + 6]
        if set(code) <= _HEX and 0xD800 <= int(code, 16) <= 0xDBFF and len(raw) < i + 12 and (
                "\\u".startswith(raw[i + 6:i + 8]) and set(raw[i + 8:]) <= _HEX):
            return i
        i += 6
    return i
