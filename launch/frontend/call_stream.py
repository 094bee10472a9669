"""Tool calls streamed piece by piece, as vLLM streams them: a call's first delta names it (with its id) once its
name and the start of its arguments are written, then its arguments follow as the model writes them.
launch/frontend/tools.py's ToolStream feeds a `CallStream` the text from where calls begin and, at the end, sends
what the unstreamed answer has beyond what went out (`rest`).

What goes out is sure to begin the unstreamed answer's arguments when the text goes on to be the calls it began:
a call's arguments go through a `JsonPrefix` (launch/frontend/json_prefix.py) in the form the parser answers
them in (re-dumped JSON for hermes, "required" and Mistral's array; the text as written for Mistral's v11 calls
and DeepSeek-V3's json blocks; GLM-4.5's values one whole value at a time, typed as the unstreamed answer types
them). A call written in a way these readers do not follow (keys in another order, say) stops the streaming
there: it, and every call after it, comes whole at the end, as before. What went out cannot be taken back, so a
stream and the unstreamed answer differ (it is logged) when the text stops being the calls it began (cut short
inside one, not JSON after all: the answer drops that call or makes the text content), or when the answer
re-writes what went out (a key repeated in the arguments: json.loads keeps the last value; a lone surrogate
after non-ASCII text, which makes the answer escape all non-ASCII).

Per format (`READERS`, by parser; `REQUIRED` for tool_choice "required"), a reader has `begin`, the text that
begins each call, and `header(text, pos)`, which finds the next call at or after pos: `Found(name, at)` (its
arguments start at `at`), `Skip(pos)` (a call the answer drops; look again from pos) or None (not yet known);
`arguments()` reads one call's arguments; `close` is the text after the arguments that ends a call (looked for
before the next call is). Each piece of text is read once, whatever the output's length: a call's arguments are
fed to their reader as they come, and only the text between calls is kept.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .json_prefix import JsonPrefix
from .tool_parsers import PARSERS, Schemas, coerce, dumps

log = logging.getLogger(__name__)

_NAME = r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"'     # a JSON string's text, escapes as written
MAX_HEADER = 1024       # a call whose header has not matched this far past its begin is one these readers do not follow


@dataclass(frozen=True, slots=True)
class Found:
    name: str
    at: int


@dataclass(frozen=True, slots=True)
class Skip:
    pos: int


class _Reader:
    begin = ""      # the text that begins each call ("": a call follows where the last one closed)
    close = ""

    def arguments(self):
        return JsonPrefix()


class _Tagged(_Reader):
    """hermes: <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>, name first."""

    begin = "<tool_call>"
    close = "</tool_call>"
    _head = re.compile(r'<tool_call>\s*\{\s*' + _NAME + r'\s*,\s*"arguments"\s*:\s*')

    def header(self, text: str, pos: int):
        return _found(self._head.match(text, pos))


class _Listed(_Reader):
    """A JSON array of {"name": NAME, KEY: ARGS} objects: "required"'s (KEY "parameters") and Mistral's before
    v11 (after its [TOOL_CALLS], KEY "arguments", which must be an object or array: a string or null is
    answered otherwise)."""

    close = "}"

    def __init__(self, key: str, lead: str = "", opens: str | None = None):
        self._first = re.compile(re.escape(lead) + r'\s*\[\s*\{\s*' + _NAME + rf'\s*,\s*"{key}"\s*:\s*')
        self._next = re.compile(r'\s*,\s*\{\s*' + _NAME + rf'\s*,\s*"{key}"\s*:\s*')
        self.opens, self._started = opens, False

    def header(self, text: str, pos: int):
        found = _found((self._next if self._started else self._first).match(text, pos))
        self._started = self._started or found is not None
        return found

    def arguments(self):
        return JsonPrefix(opens=self.opens)


class _Mistral(_Reader):
    """Mistral's: [TOOL_CALLS] then a JSON array (before v11; `_Listed`), or NAME[ARGS]{...} after each
    [TOOL_CALLS] (v11), its arguments the JSON value as written. A lone object after [TOOL_CALLS] comes whole."""

    def __init__(self):
        self.mode: str | None = None
        self._listed = _Listed("arguments", "[TOOL_CALLS]", opens="{[")

    begin = property(lambda self: "[TOOL_CALLS]" if self.mode == "named" else "")
    close = property(lambda self: self._listed.close if self.mode == "listed" else "")

    def header(self, text: str, pos: int):
        if self.mode is None:
            lead = text[len("[TOOL_CALLS]"):].lstrip()
            if not lead:
                return None
            self.mode = "listed" if lead[0] == "[" else "object" if lead[0] == "{" else "named"
        if self.mode != "named":
            return self._listed.header(text, pos) if self.mode == "listed" else None
        at = pos + len("[TOOL_CALLS]")
        ends = [e for e in (text.find("[ARGS]", at), text.find("{", at)) if e >= 0]
        end = min(ends, default=-1)
        if end < 0 or "[TOOL_CALLS]" in text[at:end] or not text[at:end].strip():
            return None
        return Found(text[at:end].strip(), end + len("[ARGS]") if text.startswith("[ARGS]", end) else end)

    def arguments(self):
        return JsonPrefix(canonical=self.mode != "named", opens="{[" if self.mode != "named" else None)


class _DeepSeek(_Reader):
    """DeepSeek-V3's: <｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>, ARGS as
    written on one line."""

    begin = "<｜tool▁call▁begin｜>"
    _head = re.compile(r"<｜tool▁call▁begin｜>[^\n]*<｜tool▁sep｜>([^\n]*)\n```json\n")

    def header(self, text: str, pos: int):
        if (m := self._head.match(text, pos)) is not None:
            return Found(m.group(1), m.end())
        if "\n```json\n" in text[pos:] or text.find(self.begin, pos + 1) >= 0:     # not a call: look further on
            return Skip(pos + 1)
        return None

    def arguments(self):
        return _Line("\n```<｜tool▁call▁end｜>")


class _Line:
    """One line's text as written, up to `end` (which must follow it)."""

    def __init__(self, end: str):
        self._end, self._tail, self._length = end, None, 0     # _tail: the text from the line's end on
        self.done = self.failed = False
        self.end = 0

    def feed(self, text: str) -> str:
        if self.done or self.failed:
            return ""
        out = ""
        if self._tail is None:
            if (line := text.find("\n")) < 0:
                self._length += len(text)
                return text
            out, self._tail, self._length = text[:line], text[line:], self._length + line
        else:
            self._tail += text
        if self._tail.startswith(self._end):
            self.done, self.end = True, self._length + len(self._end)
        elif not self._end.startswith(self._tail):
            self.failed = True      # a second line: the answer does not take this call
            return ""
        return out


class _Glm(_Reader):
    """GLM-4.5's: <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>; a name that is
    not one of the request's tools is dropped."""

    begin = "<tool_call>"

    def __init__(self, schemas: Schemas):
        self.schemas = schemas

    def header(self, text: str, pos: int):
        at = pos + len("<tool_call>")
        ends = [e for e in (text.find("<arg_key>", at), text.find("</tool_call>", at)) if e >= 0]
        if not ends:
            return None
        name = text[at:min(ends)].strip()
        if name in self.schemas:
            self._name = name
            return Found(name, min(ends))
        close = text.find("</tool_call>", at)
        return None if close < 0 else Skip(close + len("</tool_call>"))

    def arguments(self):
        properties = self.schemas[self._name].get("properties")
        return _GlmArgs(properties if isinstance(properties, dict) else {})


class _GlmArgs:
    """A GLM-4.5 call's arguments as dumps writes the dict of its typed values: "{" at once, then each value
    whole, once its </arg_value> came, "}" at its </tool_call>."""

    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
    _tags = ("</arg_value>", "</tool_call>")

    def __init__(self, properties: dict):
        self.properties, self.keys = properties, set()
        self._parts: list[str] = []
        self._tail = ""     # the last characters fed, that may begin a tag the next piece ends
        self._seen = 0      # characters fed
        self._pos = 0       # where the next pair is looked for
        self.done = self.failed = False
        self.end = 0

    def feed(self, text: str) -> str:
        if self.done or self.failed:
            return ""
        out = ["{"] if not self._seen else []
        window, self._tail = self._tail + text, (self._tail + text)[-len("</tool_call>"):]
        self._parts.append(text)
        self._seen += len(text)
        if not any(tag in window for tag in self._tags):    # nothing can end here: join nothing
            return "".join(out)
        whole = "".join(self._parts)
        self._parts = [whole]
        close = whole.find("</tool_call>", self._pos)
        body = whole if close < 0 else whole[:close]
        while m := self._pair.search(body, self._pos):
            key, value = m.group(1).strip(), m.group(2)
            if key in self.keys:
                self.failed = True
                return ""
            schema = self.properties.get(key)
            typed = coerce(value, schema) if isinstance(schema, dict) else value
            out.append((", " if self.keys else "") + dumps(key) + ": " + dumps(typed))
            self.keys.add(key)
            self._pos = m.end()
        if close >= 0:
            out.append("}")
            self.done, self.end = True, close + len("</tool_call>")
        return "".join(out)


READERS: dict[object, Callable[[Schemas], _Reader]] = {     # by tool_parsers.Parser
    PARSERS["hermes"]: lambda schemas: _Tagged(),
    PARSERS["glm45"]: _Glm,
    PARSERS["mistral"]: lambda schemas: _Mistral(),
    PARSERS["deepseek_v3"]: lambda schemas: _DeepSeek(),
}
REQUIRED = lambda schemas: _Listed("parameters")       # noqa: E731


def _found(m: re.Match | None) -> Found | None:
    if m is None:
        return None
    try:
        return Found(json.loads('"' + m.group(1) + '"'), m.end())
    except ValueError:
        return None


def rest_of(call, index: int, sent: str) -> str | None:
    """What call's arguments (a tool_parsers.Call, the unstreamed answer's call `index`) have beyond `sent`, the
    text that went out of them; None (logged) when they do not begin with it."""
    if call.arguments.startswith(sent):
        return call.arguments[len(sent):]
    log.warning("streamed tool call %d's arguments %r do not begin the answer's %r", index, sent, call.arguments)
    return None


@dataclass(slots=True)
class CallStream:
    """The deltas of the calls in a growing text (`add` each piece), and what each call sent (`sent`: (name, the
    pieces of its arguments) per index). At most `limit` calls (parallel_tool_calls false: 1)."""

    reader: _Reader
    call_id: Callable[[], str]
    limit: int | None = None
    sent: list[tuple[str, list[str]]] = field(default_factory=list)
    text: str = ""          # the text not yet read into a call's arguments, from where the last call closed
    stopped: bool = False   # a call these readers do not follow: the rest comes at the end
    _args: object = None    # the open call's arguments reader
    _fed: int = 0           # characters fed to it
    _pos: int = 0           # where in text the next call is looked for
    _closing: bool = False  # the last call's arguments ended; its close (reader.close) has not come

    def add(self, piece: str) -> list[dict]:
        out: list[dict] = []
        if self.stopped:
            return out
        if self._args is not None:
            self._feed(piece, out)
        else:
            self.text += piece
        while not self.stopped and self._args is None and self._open(out):
            self._feed(self.text[self._pos:], out)
        return out

    def _feed(self, text: str, out: list[dict]) -> None:
        """Feed the open call's arguments reader text; once they end, keep what follows them and close the call."""
        more = self._args.feed(text)
        self._fed += len(text)
        if more:
            self.sent[-1][1].append(more)
            if out and out[-1]["index"] == len(self.sent) - 1:
                out[-1]["function"]["arguments"] += more
            else:
                out.append({"index": len(self.sent) - 1, "function": {"arguments": more}})
        if self._args.failed:
            self.stopped = True
        elif self._args.done:       # the end lies in this text: what follows it is kept
            self.text, self._pos, self._args = text[len(text) - (self._fed - self._args.end):], 0, None
            self._closing = bool(self.reader.close)

    def _open(self, out: list[dict]) -> bool:
        """Look for the next call in text; True when one opened (its first delta in out, text from its arguments'
        start at self._pos)."""
        reader, text = self.reader, self.text
        if self._closing:
            if (close := text.find(reader.close)) < 0:      # keep only what may begin it
                self.text = text[max(0, len(text) - len(reader.close) + 1):]
                return False
            self.text, self._pos, self._closing = text[close + len(reader.close):], 0, False
            text = self.text
        while True:
            if reader.begin:
                at = text.find(reader.begin, self._pos)
                if at < 0:      # keep only what may begin the next call
                    self.text, self._pos = text[max(0, len(text) - len(reader.begin) + 1):], 0
                    return False
                self._pos = at
            found = reader.header(text, self._pos)
            if isinstance(found, Skip):
                self._pos = found.pos
                continue
            if found is None:
                self.stopped = len(text) - self._pos > MAX_HEADER
                return False
            if self.limit is not None and len(self.sent) >= self.limit:
                self.stopped = True
                return False
            self._args, self._fed, self._pos = reader.arguments(), 0, found.at
            self.sent.append((found.name, []))
            out.append({"index": len(self.sent) - 1, "id": self.call_id(), "type": "function",
                        "function": {"name": found.name, "arguments": ""}})
            return True

    def rest(self, calls: list) -> list[dict]:
        """The final deltas: for each call of the unstreamed answer (tool_parsers.Call) that agrees with the one
        that went out at its index, what it has beyond it; the answer's calls from the first that does not
        (another name, or none: the stream sent one the answer dropped) go out whole after those sent."""
        out, agree = [], len(self.sent)
        for k, (name, pieces) in enumerate(self.sent):
            if k >= len(calls) or calls[k].name != name:
                log.warning("tool call %d streamed as %s is %s in the answer", k, name,
                            calls[k].name if k < len(calls) else "not")
                agree = k
                break
            if more := rest_of(calls[k], k, "".join(pieces)):
                out.append({"index": k, "function": {"arguments": more}})
        return out + [c.answer(self.call_id(), index=len(self.sent) + j) for j, c in enumerate(calls[agree:])]
