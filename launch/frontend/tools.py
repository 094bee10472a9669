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
  models mark <tool_call> special; vLLM's hermes parser does the same). The parsers (hermes, deepseek_v3, glm45,
  mistral) are launch/frontend/tool_parsers.py's.
- parallel_tool_calls false: only the first call is answered.

Streamed: a named function's arguments stream as they come (the first delta names the function and carries the
call's id). "auto" sends as content the text before the first text that begins calls (the parser's start, e.g.
"<tool_call>"), holding a tail that may begin it and whitespace before any text. From there, and for "required"
from the start, each call goes out piece by piece, as vLLM's do: its first delta names it as soon as its name is
known, then its arguments follow as they are written, in the form the unstreamed answer gives them
(launch/frontend/call_stream.py). The chunk that carries the finish_reason sends what the unstreamed answer has
beyond that (the rest of the content; calls, or the rest of them, that did not go out), so when the text is the
calls it began the two agree. A text that stops being calls once some went out (cut short inside a call, or not
JSON after all) cannot take them back: that stream then has calls the unstreamed answer lacks, no more content
(the answer's would be their text), and finish_reason "tool_calls" if the engine stopped, else its reason
("length"), as vLLM's streams.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .call_stream import READERS, REQUIRED, CallStream
from .chat import ChatCompletionRequest
from .protocol import APIError
from .text import tag_overlap
from .tool_parsers import PARSERS, Call, Parser, Schemas, dumps

def required_calls(text: str) -> list[Call] | None:
    """The calls of "required"'s JSON array of {"name", "parameters"}, or None when text is not one (cut short)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not items or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i for i in items):
        return None
    return [Call(i["name"], dumps(i["parameters"])) for i in items]


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
                   PARSERS.get(parser or "hermes", PARSERS["hermes"]), schemas)     # harmony: its own

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
    in_calls: bool = False      # "auto": the parser's start came; the rest goes to `calls` (and the end decides)
    named_id: str | None = None     # the named function's call id, once its first delta went
    found: bool = False
    broken: bool = False        # calls went out, and the answer has none (cut short inside one, or not JSON)
    calls: CallStream | None = None     # "auto" and "required": the calls streamed so far

    def __post_init__(self) -> None:
        reader = REQUIRED if self.plan.mode == "required" else READERS.get(self.plan.parser)
        if self.plan.mode != "named" and reader is not None:
            self.calls = CallStream(reader(self.plan.schemas), self.plan.parser.call_id,
                                    None if self.plan.parallel else 1)

    def add(self, piece: str, final: bool) -> dict:
        """The delta for this piece: {"content": ...}, {"tool_calls": [...]}, both, or {} (nothing to send)."""
        self.parts.append(piece)
        if self.plan.mode == "named":
            return self._named(piece)
        if self.plan.mode == "required" or self.in_calls:
            delta, calls_text = {}, piece
        else:
            delta = self._content(piece)
            calls_text = self.pending[self.pending.find(self.plan.parser.start):] if self.in_calls else ""
        if not final:
            if calls_text and self.calls is not None and (deltas := self.calls.add(calls_text)):
                delta["tool_calls"] = deltas
            return delta
        content, calls = self.plan.calls("".join(self.parts))
        self.found, self.broken = bool(calls), not calls and bool(self.calls and self.calls.sent)
        rest = (content or "")[self.num_sent:]
        if rest and not self.broken:        # broken: the answer's content past what went out is the calls' text
            delta["content"] = delta.get("content", "") + rest
        deltas = self.calls.rest(calls) if self.calls is not None else [
            c.answer(self.plan.parser.call_id(), index=k) for k, c in enumerate(calls)]
        if deltas:
            delta["tool_calls"] = deltas
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
        """The answer's; when calls went out that the answer lacks, vLLM's for a stream: "tool_calls" if the
        engine stopped, else its reason ("length": cut short)."""
        if self.broken:
            return "tool_calls" if finish == "stop" else finish
        return self.plan.finish_reason(self.found, finish)
