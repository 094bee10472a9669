"""Tool calls streamed piece by piece, as vLLM streams them: a call's first delta names it (with its id) as soon as
its name is known, then its arguments follow as the model writes them. launch/frontend/tools.py's ToolStream
feeds a `CallStream` the text from where calls begin and, at the end, sends what the unstreamed answer has
beyond what went out.

What goes out is sure to begin the unstreamed answer's arguments when the text goes on to be the calls it began:
a call's arguments go through a `JsonPrefix` (launch/frontend/json_prefix.py) in the form the parser answers
them in (re-dumped JSON for hermes, "required" and Mistral's array; the text as written for Mistral's v11 calls
and DeepSeek-V3's json blocks; GLM-4.5's values one whole value at a time, typed as the unstreamed answer types
them). A call written in a way these readers do not follow (keys in another order, say) stops the streaming
there: it, and every call after it, comes whole at the end, as before. A text that stops being calls once some
went out (cut short inside one, or not JSON after all) cannot take them back: the unstreamed answer then has no
call, or another, where the stream sent one (vLLM's streams do the same); that is logged.

Per format (`READERS`, by parser; `REQUIRED` for tool_choice "required"), a reader's `header(text, pos)` finds
the next call at or after pos: `Found(name, at)` (its arguments start at `at`), `Skip(pos)` (a call the answer
drops; look again from pos) or None (not yet known); `arguments()` reads one call's arguments; `close` is the
text after the arguments that ends a call (looked for before the next call is).
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


@dataclass(frozen=True, slots=True)
class Found:
    name: str
    at: int


@dataclass(frozen=True, slots=True)
class Skip:
    pos: int


class _Reader:
    close = ""

    def arguments(self):
        return JsonPrefix()


class _Tagged(_Reader):
    """hermes: <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>, name first."""

    close = "</tool_call>"
    _head = re.compile(r'<tool_call>\s*\{\s*' + _NAME + r'\s*,\s*"arguments"\s*:\s*')

    def header(self, text: str, pos: int):
        at = text.find("<tool_call>", pos)
        return None if at < 0 else _found(self._head.match(text, at))


class _Listed(_Reader):
    """A JSON array of {"name": NAME, KEY: ARGS} objects: "required"'s (KEY "parameters") and Mistral's before
    v11 (after its [TOOL_CALLS], KEY "arguments", which must be an object or array: a string or null is
    answered otherwise)."""

    close = "}"

    def __init__(self, key: str, lead: str = "", opens: str | None = None):
        self._first = re.compile(re.escape(lead) + r'\s*\[\s*\{\s*' + _NAME + rf'\s*,\s*"{key}"\s*:\s*')
        self._next = re.compile(r'\s*,\s*\{\s*' + _NAME + rf'\s*,\s*"{key}"\s*:\s*')
        self.opens = opens

    def header(self, text: str, pos: int):
        return _found((self._next if pos else self._first).match(text, pos))

    def arguments(self):
        return JsonPrefix(opens=self.opens)


class _Mistral(_Reader):
    """Mistral's: [TOOL_CALLS] then a JSON array (before v11; `_Listed`), or NAME[ARGS]{...} after each
    [TOOL_CALLS] (v11), its arguments the JSON value as written. A lone object after [TOOL_CALLS] comes whole."""

    _listed = _Listed("arguments", "[TOOL_CALLS]", opens="{[")

    def __init__(self):
        self.mode: str | None = None

    @property
    def close(self) -> str:
        return self._listed.close if self.mode == "listed" else ""

    def header(self, text: str, pos: int):
        if self.mode is None:
            lead = text[len("[TOOL_CALLS]"):].lstrip()
            if not lead:
                return None
            self.mode = "listed" if lead[0] == "[" else "object" if lead[0] == "{" else "named"
        if self.mode != "named":
            return self._listed.header(text, pos) if self.mode == "listed" else None
        at = text.find("[TOOL_CALLS]", pos)
        if at < 0:
            return None
        at += len("[TOOL_CALLS]")
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

    _head = re.compile(r"<｜tool▁call▁begin｜>[^\n]*<｜tool▁sep｜>([^\n]*)\n```json\n")

    def header(self, text: str, pos: int):
        m = self._head.search(text, pos)
        return None if m is None else Found(m.group(1), m.end())

    def arguments(self):
        return _Line("\n```<｜tool▁call▁end｜>")


class _Line:
    """One line's text as written, up to `end` (which must follow it)."""

    def __init__(self, end: str):
        self._end, self._text, self._sent = end, "", 0
        self.done = self.failed = False
        self.end = 0

    def feed(self, text: str) -> str:
        if self.done or self.failed:
            return ""
        self._text += text
        line = self._text.find("\n")
        if line < 0:
            cut = len(self._text)
        elif self._text.startswith(self._end, line):
            cut, self.done, self.end = line, True, line + len(self._end)
        elif self._end.startswith(self._text[line:]):
            cut = line
        else:
            self.failed = True
            return ""
        out, self._sent = self._text[self._sent:cut], cut
        return out


class _Glm(_Reader):
    """GLM-4.5's: <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>; a name that is
    not one of the request's tools is dropped."""

    def __init__(self, schemas: Schemas):
        self.schemas = schemas

    def header(self, text: str, pos: int):
        at = text.find("<tool_call>", pos)
        if at < 0:
            return None
        at += len("<tool_call>")
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

    def __init__(self, properties: dict):
        self.properties, self.keys = properties, set()
        self._text, self._pos = "", 0
        self.done = self.failed = False
        self.end = 0

    def feed(self, text: str) -> str:
        if self.done or self.failed:
            return ""
        out = ["{"] if not self._text and not self._pos else []
        self._text += text
        close = self._text.find("</tool_call>", max(0, len(self._text) - len(text) - len("</tool_call>")))
        body = self._text if close < 0 else self._text[:close]
        while body.find("</arg_value>", self._pos) >= 0 and (m := self._pair.search(body, self._pos)):
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


def rest_of(call, index: int, sent: str) -> str:
    """What call's arguments (a tool_parsers.Call, the unstreamed answer's call `index`) have beyond `sent`, the
    text that went out of them; "" (logged) when they do not begin with it."""
    if call.arguments.startswith(sent):
        return call.arguments[len(sent):]
    log.warning("streamed tool call %d's arguments %r do not begin the answer's %r", index, sent, call.arguments)
    return ""


def _found(m: re.Match | None) -> Found | None:
    if m is None:
        return None
    try:
        return Found(json.loads('"' + m.group(1) + '"'), m.end())
    except ValueError:
        return None


@dataclass(slots=True)
class CallStream:
    """The deltas of the calls in a growing text (`add` each piece), and what each call sent (`sent`: [name,
    arguments] per index). At most `limit` calls (parallel_tool_calls false: 1)."""

    reader: _Reader
    call_id: Callable[[], str]
    limit: int | None = None
    sent: list[list[str]] = field(default_factory=list)
    text: str = ""
    stopped: bool = False   # a call these readers do not follow: the rest comes at the end
    _args: object = None    # the open call's arguments reader
    _fed: int = 0           # characters of text fed to it
    _at: int = 0            # where its arguments start
    _pos: int = 0           # where the next call is looked for

    def add(self, piece: str) -> list[dict]:
        self.text += piece
        out: list[dict] = []
        while not self.stopped:
            if self._args is None and not self._open(out):
                break
            more = self._args.feed(self.text[self._fed:])
            self._fed = len(self.text)
            if more:
                self.sent[-1][1] += more
                if out and out[-1]["index"] == len(self.sent) - 1:
                    out[-1]["function"]["arguments"] += more
                else:
                    out.append({"index": len(self.sent) - 1, "function": {"arguments": more}})
            if self._args.failed:
                self.stopped = True
            if not self._args.done:
                break
            end = self._at + self._args.end
            close = self.text.find(self.reader.close, end) if self.reader.close else end
            if close < 0:
                break
            self._args, self._pos = None, close + len(self.reader.close)
        return out

    def _open(self, out: list[dict]) -> bool:
        """Look for the next call; True when one opened (its first delta in out)."""
        while (found := self.reader.header(self.text, self._pos)) is not None:
            if isinstance(found, Skip):
                self._pos = found.pos
                continue
            if self.limit is not None and len(self.sent) >= self.limit:
                self.stopped = True
                return False
            self._args, self._at, self._fed = self.reader.arguments(), found.at, found.at
            self.sent.append([found.name, ""])
            out.append({"index": len(self.sent) - 1, "id": self.call_id(), "type": "function",
                        "function": {"name": found.name, "arguments": ""}})
            return True
        return False

    def rest(self, calls: list) -> list[dict]:
        """The final deltas: for each call of the unstreamed answer (tool_parsers.Call), what it has beyond what
        went out, or the whole call when none of it did."""
        out = []
        for k, call in enumerate(calls):
            if k >= len(self.sent):
                out.append(call.answer(self.call_id(), index=k))
                continue
            name, sent = self.sent[k]
            if call.name != name:
                log.warning("streamed tool call %d is %s, the answer's %s", k, name, call.name)
            elif more := rest_of(call, k, sent):
                out.append({"index": k, "function": {"arguments": more}})
        if len(calls) < len(self.sent):
            log.warning("%d tool calls streamed, the answer has %d", len(self.sent), len(calls))
        return out
