"""How tool_choice "auto" finds calls in a model's text (the server's --tool-call-parser), as vLLM 0.32's parsers do.
A parser is its `start`, the text that begins calls, and `calls`, (text, the request's tools) -> (the content,
None when empty; the calls), or None when the text holds no call (then it is all content). launch/frontend/tools.py
makes the answers.

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
from dataclasses import dataclass

_START = "<tool_call>"
_ALPHANUMERIC = string.ascii_letters + string.digits
_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)     # hermes' and glm45's calls
_DS_START = "<｜tool▁calls▁begin｜>"
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_MISTRAL_START, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)     # pre-v11 calls that do not open the text (vLLM's fallback)
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


def dumps(value) -> str:
    """A call's arguments as JSON text, non-ASCII kept as written (vLLM's), unless it holds a lone surrogate (JSON
    can write "\\ud800", UTF-8 cannot): then escaped, so the answer can be sent."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


Schemas = dict[str, dict]      # the request's tools: name -> parameters schema ({} when it declares none)


def hermes_calls(text: str, schemas: Schemas) -> tuple[str | None, list[Call]] | None:
    """(the content before the first call, None when empty; the calls) for Hermes-style calls in text, or None
    when it holds none, or one that is not {"name": str, "arguments": ...} JSON (then it is all content)."""
    if _START not in text:
        return None
    calls = []
    for closed, unclosed in _TAGGED.findall(text):
        try:
            obj = json.loads(closed or unclosed)
        except (ValueError, RecursionError):     # not JSON, or nested deeper than the parser goes
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            return None
        calls.append(Call(obj["name"], dumps(obj["arguments"])))
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
    for closed, unclosed in _TAGGED.findall(text):
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
        calls.append(Call(name, dumps(args)))
    return _TAGGED.sub("", text) or None, calls


def mistral_calls(text: str, schemas: Schemas) -> tuple[str | None, list[Call]] | None:
    """(the content before the first [TOOL_CALLS], None when empty; the calls) for Mistral-style calls in text, or
    None when it holds none (or only a JSON value that holds no call)."""
    if _MISTRAL_START not in text:
        return None
    content, *segments = text.split(_MISTRAL_START)
    segments = [seg.strip() for seg in segments if seg.strip()]
    if segments and segments[0][0] in "[{":      # before v11: one JSON array of calls (or one call)
        found = _leading_json(segments[0]) or _leading_json(m.group(0) if (m := _ARRAY.search(segments[0])) else "")
        calls = _listed_calls(found[0] if found else None)
        return (content or None, calls) if calls else None
    calls = []
    for seg in segments:        # from v11: NAME[ARGS]{...} or NAME{...}, each after its own [TOOL_CALLS]
        ends = [at for at in (seg.find(_MISTRAL_ARGS), seg.find("{")) if at >= 0]
        at = min(ends, default=len(seg))
        args = seg[at + len(_MISTRAL_ARGS):] if seg.startswith(_MISTRAL_ARGS, at) else seg[at:]
        args = args.strip()
        found = _leading_json(args)
        calls.append(Call(seg[:at].strip(), args[:found[1]] if found else args or "{}"))
    return content or None, calls


def _leading_json(text: str) -> tuple[object, int] | None:
    """(the JSON value at text's start, where it ends; what follows it is ignored), or None when none is."""
    try:
        return json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):
        return None


def _listed_calls(parsed) -> list[Call]:
    """The calls of a JSON value listing {"name", "arguments"} objects (vLLM's pre-v11 Mistral rules)."""
    items = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not ("name" in item or "arguments" in item):
            continue
        args = item.get("arguments")
        args = "{}" if args is None else args if isinstance(args, str) else dumps(args)
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


# type names as vLLM reads them besides JSON schema's (a tool's schema may say "int" or "str")
_ALIASES = {**dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
            **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
                            "integer"),
            **dict.fromkeys(("float", "float32", "float64", "double"), "number"), "bool": "boolean",
            "dict": "object", **dict.fromkeys(("arr", "list", "sequence"), "array")}
_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object"}


def coerce(value: str, schema: dict):
    """A call's text value as the type its schema allows, tried in vLLM's order: null ("null"), integer, number
    (finite; integral ones as integers), boolean ("true"/"1", "false"/"0"), object or array (JSON), string. When
    none fits and string is not allowed: the value as JSON if it is finite JSON, else the text. Type names are
    read as vLLM reads them: any case, and "int", "str", "float", "bool", "list", "dict" and such for theirs."""
    types = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in schema_types(schema)}
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


HARMONY = "openai"      # GPT-OSS's harmony messages: launch/frontend/harmony.py reads their calls
PARSERS = {"hermes": Parser(_START, hermes_calls), "deepseek_v3": Parser(_DS_START, deepseek_v3_calls),
           "glm45": Parser(_START, glm45_calls),
           "mistral": Parser(_MISTRAL_START, mistral_calls, lambda: "".join(random.choices(_ALPHANUMERIC, k=9)))}
NAMES = sorted([*PARSERS, HARMONY])    # what --tool-call-parser takes
