"""Tool calls in chat answers, as vLLM 0.32 answers them (the request side, and the structured output a named
function or "required" asks for, are launch/frontend/chat.py's).

- tool_choice "none" (the default without tools): plain text; the tools still reach the chat template.
- A named function: the output, constrained to the function's parameters schema, is its arguments: one call,
  content "", finish_reason the engine's ("stop", as OpenAI's). An output of whitespace alone makes no call.
- "required": the output, constrained to a JSON array of {"name", "parameters"} objects (at most one with
  parallel_tool_calls false), is one call per item; content "", finish_reason "tool_calls" when the output ended
  by itself. An output that is not such an array (cut short) makes no call, content "".
- "auto" (the default with tools): the server's --enable-auto-tool-choice with --tool-call-parser (else a 400, as
  vLLM). The model writes what it likes; the parser finds the calls in it. When it finds some, they are the
  answer's tool_calls, the text before the first is its content (null when empty or whitespace), and
  finish_reason is "tool_calls"; otherwise the whole text is content. Special tokens stay in the text (some
  models mark <tool_call> special; vLLM's hermes parser does the same). Parsers:
    hermes       calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes 2 Pro and later,
                 Qwen2.5 and Qwen3); the last one may be left unclosed. A call that is not such JSON leaves the
                 whole text as content.
    deepseek_v3  DeepSeek-V3's (and R1's) <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                 then the arguments in a ```json block on one line, <｜tool▁call▁end｜>; calls not so written are
                 dropped, and the content is the text before <｜tool▁calls▁begin｜> (vLLM's).
    glm45        GLM-4.5's (and 4.6's, 4.7's) <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...
                 </tool_call>, the last one maybe unclosed (its unclosed value is dropped). The name is stripped and
                 must be one of the request's tools (a call naming another is dropped, as vLLM's). Each value is
                 text, turned into the type its parameter's schema names (`coerce`, vLLM's order: null, integer,
                 number, boolean, object or array, string); a key the schema does not declare stays text. The
                 content is the text outside the calls, as the model wrote it (vLLM also strips it of leading and
                 trailing whitespace when it found calls; here a stream could not know that before the end).
    mistral      Mistral's and Mixtral's [TOOL_CALLS]: before v11 (Mixtral-8x22B) [TOOL_CALLS] then a JSON array of
                 {"name", "arguments"} (or one object; items that are neither skipped, a missing name ""); from v11
                 each call as [TOOL_CALLS]NAME[ARGS]{...} (or NAME{...}), its arguments the first JSON value as
                 written. The content is the text before the first [TOOL_CALLS]. Call ids are 9 letters and digits,
                 which Mistral's chat templates require of the calls sent back (vLLM's). A JSON array that holds
                 no call leaves all the text as content (vLLM answers the array's text).
- parallel_tool_calls false: only the first call is answered.

Streamed: a named function's arguments stream as they come (the first delta names the function and carries the
call's id). "required" and "auto" hold back what may be calls (all of "required"'s output; "auto"'s text from the
first text that begins calls (the parser's start, e.g. "<tool_call>"), a tail that may begin it, or whitespace
before any text) and decide at the end as the
unstreamed answer does, so the two always agree: the calls come whole in the chunk that carries the
finish_reason, or the held text as content.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from .chat import ChatCompletionRequest
from .protocol import APIError
from .text import tag_overlap

_START = "<tool_call>"
_ALPHANUMERIC = string.ascii_letters + string.digits
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_DS_START = "<｜tool▁calls▁begin｜>"
_GLM_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_MISTRAL_START, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*)<｜tool▁sep｜>(?P<name>.*)\n```json\n(?P<arguments>.*)\n```"
                      r"<｜tool▁call▁end｜>")


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str       # JSON text

    def answer(self, call_id: str, **index) -> dict:
        """The call in an answer, under a fresh id (index=k: a stream's delta names its place)."""
        function = {"name": self.name, "arguments": self.arguments}
        return index | {"id": call_id, "type": "function", "function": function}


Schemas = dict[str, dict]      # the request's tools: name -> parameters schema ({} when it declares none)


def hermes_calls(text: str, schemas: Schemas) -> tuple[str | None, list[Call]] | None:
    """(the content before the first call, None when empty; the calls) for Hermes-style calls in text, or None
    when it holds none, or one that is not {"name": str, "arguments": ...} JSON (then it is all content)."""
    if _START not in text:
        return None
    calls = []
    for closed, unclosed in _HERMES.findall(text):
        try:
            obj = json.loads(closed or unclosed)
        except (ValueError, RecursionError):     # not JSON, or nested deeper than the parser goes
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            return None
        calls.append(Call(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    return text[:text.index(_START)] or None, calls


def deepseek_v3_calls(text: str, schemas: Schemas) -> tuple[str | None, list[Call]] | None:
    """(the content before the calls, None when empty; the calls, maybe none) for DeepSeek-V3-style calls in text,
    or None when it holds none. Each call's arguments are the text of its json block, as the model wrote it."""
    if _DS_START not in text:
        return None
    calls = [Call(m.group("name"), m.group("arguments")) for m in _DS_CALL.finditer(text)]
    return text[:text.index(_DS_START)] or None, calls


def glm45_calls(text: str, schemas: Schemas) -> tuple[str | None, list[Call]] | None:
    """(the text outside the calls, None when empty; the calls of the request's tools) for GLM-4.5-style calls in
    text, or None when it holds none."""
    if _START not in text:
        return None
    calls = []
    for closed, unclosed in _GLM_CALL.findall(text):
        body = closed or unclosed
        name = body.split("<arg_key>", 1)[0].strip()
        if name not in schemas:
            continue
        properties = schemas[name].get("properties")
        properties = properties if isinstance(properties, dict) else {}
        args = {}
        for key, value in _GLM_ARG.findall(body):
            key = key.strip()
            args[key] = coerce(value, properties[key]) if isinstance(properties.get(key), dict) else value
        calls.append(Call(name, json.dumps(args, ensure_ascii=False)))
    return _GLM_CALL.sub("", text) or None, calls


def mistral_calls(text: str, schemas: Schemas) -> tuple[str | None, list[Call]] | None:
    """(the content before the first [TOOL_CALLS], None when empty; the calls) for Mistral-style calls in text, or
    None when it holds none (or only a JSON value that holds no call)."""
    if _MISTRAL_START not in text:
        return None
    content, *segments = text.split(_MISTRAL_START)
    segments = [seg.strip() for seg in segments if seg.strip()]
    if segments and segments[0][0] in "[{":      # before v11: one JSON array of calls (or one call)
        calls = _listed_calls(_first_json(segments[0]))
        return (content or None, calls) if calls else None
    calls = []
    for seg in segments:        # from v11: NAME[ARGS]{...} or NAME{...}, each after its own [TOOL_CALLS]
        ends = [at for at in (seg.find(_MISTRAL_ARGS), seg.find("{")) if at >= 0]
        at = min(ends, default=len(seg))
        args = seg[at + len(_MISTRAL_ARGS):] if seg.startswith(_MISTRAL_ARGS, at) else seg[at:]
        calls.append(Call(seg[:at].strip(), _first_json_text(args)))
    return content or None, calls


def _first_json(text: str):
    """The first JSON value at text's start (what follows it is ignored), else the first "[{...}]" in it, else
    None."""
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except (ValueError, RecursionError):
        pass
    found = re.search(r"\[{.*}\]", text, re.DOTALL)
    try:
        return json.loads(found.group(0)) if found else None
    except (ValueError, RecursionError):
        return None


def _first_json_text(text: str) -> str:
    """The text of the first JSON value at text's start, as written; "{}" for none; all of it when it is not JSON."""
    text = text.strip()
    if not text:
        return "{}"
    try:
        return text[:json.JSONDecoder().raw_decode(text)[1]]
    except (ValueError, RecursionError):
        return text


def _listed_calls(parsed) -> list[Call]:
    """The calls of a JSON value listing {"name", "arguments"} objects (vLLM's pre-v11 Mistral rules)."""
    items = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not ("name" in item or "arguments" in item):
            continue
        args = item.get("arguments")
        args = "{}" if args is None else args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(Call(item["name"] if isinstance(item.get("name"), str) else "", args))
    return calls


def schema_types(schema) -> set[str]:
    """The JSON types a schema allows: its "type"s, its enum values' types, and those of its anyOf/oneOf/allOf
    branches; {"string"} when it names none."""
    if not isinstance(schema, dict):
        return {"string"}
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(
        kind, list) else set()
    for value in schema.get("enum") if isinstance(schema.get("enum"), list) else ():
        types.add(_JSON_TYPES.get(type(value), "string"))
    for branch in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(branch) if isinstance(schema.get(branch), list) else ():
            types |= schema_types(sub)
    return types or {"string"}


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object"}


def coerce(value: str, schema: dict):
    """A call's text value as the type its schema allows, tried in vLLM's order: null ("null"), integer, number
    (finite; integral ones as integers), boolean ("true"/"1", "false"/"0"), object or array (JSON), string. When
    none fits and string is not allowed: the value as JSON if it is finite JSON, else the text."""
    types = schema_types(schema)
    if "null" in types and value.lower() == "null":
        return None
    for kind in ("integer", "number", "boolean", "object", "array", "string"):
        if kind not in types:
            continue
        if kind == "string":
            return value
        if kind == "integer":
            with contextlib.suppress(ValueError):
                return int(value)
        elif kind == "number":
            with contextlib.suppress(ValueError):
                if math.isfinite(number := float(value)):
                    return int(number) if number == int(number) else number
        elif kind == "boolean":
            if value.strip().lower() in ("true", "1", "false", "0"):
                return value.strip().lower() in ("true", "1")
        else:
            parsed = _finite_json(value)
            if parsed is not _NOT_JSON:
                return parsed
    parsed = _finite_json(value)
    return value if parsed is _NOT_JSON else parsed


_NOT_JSON = object()


def _finite_json(text: str):
    """text as JSON, or _NOT_JSON when it is not JSON or holds a number JSON cannot write (inf, nan)."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_JSON
    try:
        json.dumps(parsed, allow_nan=False)
    except ValueError:
        return _NOT_JSON
    return parsed


@dataclass(frozen=True, slots=True)
class Parser:
    """How tool_choice "auto" finds calls: `start`, the text that begins them (a stream's content stops there),
    and `calls`, (text, the request's tools) -> (content, calls), or None when the text holds no call (then it is
    all content)."""

    start: str
    calls: Callable[[str, Schemas], tuple[str | None, list[Call]] | None]
    call_id: Callable[[], str] = lambda: "chatcmpl-tool-" + uuid.uuid4().hex     # a fresh call id (vLLM's form)


PARSERS = {"hermes": Parser(_START, hermes_calls), "deepseek_v3": Parser(_DS_START, deepseek_v3_calls),
           "glm45": Parser(_START, glm45_calls),
           "mistral": Parser(_MISTRAL_START, mistral_calls, lambda: "".join(random.choices(_ALPHANUMERIC, k=9)))}


def required_calls(text: str) -> list[Call] | None:
    """The calls of "required"'s JSON array of {"name", "parameters"}, or None when text is not one (cut short)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not items or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i for i in items):
        return None
    return [Call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


@dataclass(slots=True)
class ToolPlan:
    """How one chat request's answers show tool calls. mode: "auto", "required" or "named"."""

    mode: str
    name: str | None = None         # the named function
    parallel: bool = True           # false: only the first call is answered
    parser: Parser = PARSERS["hermes"]     # "auto"'s
    schemas: Schemas = field(default_factory=dict)     # the request's tools

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
        """body's plan (None: tool_choice "none", plain text) on a server whose auto tool choice uses `parser`
        (None: auto is not enabled: a 400, as vLLM)."""
        mode = body.choice_name()
        if mode == "none":
            return None
        if mode == "auto" and parser is None:
            why = "tool_choice is 'auto' (the default when tools are given)" if body.tool_choice is None else \
                "tool_choice='auto'"
            raise APIError(400, f"{why} needs the server started with --enable-auto-tool-choice and "
                                f"--tool-call-parser; pass tool_choice 'none', 'required' or a named function "
                                f"instead", "tool_choice")
        schemas = {t.function.name: t.function.parameters or {} for t in body.tools or []}
        return cls(mode, body.tool_choice.function.name if mode == "named" else None, body.parallel_tool_calls,
                   PARSERS[parser or "hermes"], schemas)

    @property
    def keeps_special_tokens(self) -> bool:
        """The text keeps special tokens whatever skip_special_tokens says (the parser reads them)."""
        return self.mode == "auto"

    def calls(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of the answer that text makes."""
        if self.mode == "named":
            content, calls = "", [Call(self.name, text)] if text.strip() else []
        elif self.mode == "required":
            content, calls = "", required_calls(text) or []
        elif (found := self.parser.calls(text, self.schemas)) is None:
            content, calls = text, []
        else:
            content, calls = found[0] if found[0] and found[0].strip() else None, found[1]
        return content, calls if self.parallel else calls[:1]

    def finish_reason(self, found: bool, finish: str | None) -> str | None:
        """OpenAI's: "tool_calls" when "auto" found calls, or "required" ended by itself; else the engine's."""
        if found and (self.mode == "auto" or (self.mode == "required" and finish == "stop")):
            return "tool_calls"
        return finish

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The unstreamed answer: (message, finish_reason)."""
        content, calls = self.calls(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.answer(self.parser.call_id()) for c in calls]
        return message, self.finish_reason(bool(calls), finish)

    def stream(self) -> ToolStream:
        return ToolStream(self)


@dataclass(slots=True)
class ToolStream:
    """One streamed choice's deltas under a plan: `add` each piece of text as it comes (final: the choice has
    ended), then `finish_reason`."""

    plan: ToolPlan
    parts: list[str] = field(default_factory=list)     # every piece: the whole text, joined once at the end
    pending: str = ""           # "auto" before a call, and a named call's leading whitespace: text not sent yet
    num_sent: int = 0           # "auto": characters of the text sent as content
    has_text: bool = False      # "auto": content other than whitespace went out
    in_calls: bool = False      # "auto": the parser's start came; the rest is decided at the end
    named_id: str | None = None     # the named function's call id, once its first delta went
    found: bool = False

    def add(self, piece: str, final: bool) -> dict:
        """The delta for this piece: {"content": ...}, {"tool_calls": [...]}, both, or {} (nothing to send)."""
        self.parts.append(piece)
        if self.plan.mode == "named":
            return self._named(piece)
        delta = {} if self.plan.mode == "required" or self.in_calls else self._content(piece)
        if not final:
            return delta
        content, calls = self.plan.calls("".join(self.parts))
        rest = (content or "")[self.num_sent:]
        if rest:
            delta["content"] = delta.get("content", "") + rest
        if calls:
            self.found = True
            delta["tool_calls"] = [c.answer(self.plan.parser.call_id(), index=k) for k, c in enumerate(calls)]
        return delta

    def _named(self, piece: str) -> dict:
        if self.named_id is not None:
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}
        self.pending += piece
        if not self.pending.strip():       # whitespace alone makes no call (yet)
            return {}
        first, self.pending = Call(self.plan.name, self.pending).answer(self.plan.parser.call_id(), index=0), ""
        self.named_id, self.found = first["id"], True
        return {"tool_calls": [first]}

    def _content(self, piece: str) -> dict:
        """"auto" before any call: send the text up to the parser's start, or all but a tail that may begin it; hold
        whitespace that comes before any text (it is no content if a call follows)."""
        self.pending += piece
        start = self.plan.parser.start
        at = self.pending.find(start)
        if at >= 0:
            self.in_calls = True
        else:
            at = len(self.pending) - tag_overlap(self.pending, start)
        out = self.pending[:at]
        if not self.has_text and not out.strip():
            return {}
        self.has_text = True
        self.pending, self.num_sent = self.pending[at:], self.num_sent + at
        return {"content": out} if out else {}

    def finish_reason(self, finish: str | None) -> str | None:
        return self.plan.finish_reason(self.found, finish)
