"""Tool calls in chat answers, as vLLM answers them (the request side, and the structured output a named function
or "required" asks for, are launch/frontend/chat.py's).

- tool_choice "none" (the default without tools): plain text; the tools still reach the chat template.
- A named function: the output, constrained to the function's parameters schema, is its arguments: one call,
  content "", finish_reason the engine's ("stop", as OpenAI's).
- "required": the output, constrained to a JSON array of {"name", "parameters"} objects, is one call per item;
  content "", finish_reason "tool_calls" when the output ended by itself.
- "auto" (the default with tools): the server's --enable-auto-tool-choice with --tool-call-parser (else a 400, as
  vLLM). The model writes what it likes; the parser finds the calls in it. When it finds some, they are the
  answer's tool_calls, the text before the first is its content (null when empty), and finish_reason is
  "tool_calls"; otherwise the whole text is content. Parsers:
    hermes  calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes 2 Pro and later, Qwen2.5
            and Qwen3); the last one may be left unclosed. A call that is not such JSON leaves the whole text as
            content. Special tokens stay in the text (some models mark <tool_call> special).
- parallel_tool_calls false: only the first call is answered.

Streamed: a named function's arguments stream as they come (the first delta names the function and carries the
call's id). "required" and "auto" hold back what may be calls (all of "required"'s output; "auto"'s from the first
"<tool_call>", or a tail that may start one) and decide at the end, as the unstreamed answer does, so the two
always agree: the calls come in one delta before the last chunk, or the held text as content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .chat import ChatCompletionRequest
from .protocol import APIError

PARSERS = ("hermes",)

_START, _END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str       # JSON text


def hermes_calls(text: str) -> tuple[str | None, list[Call]] | None:
    """(the content before the first call, None when empty; the calls) for Hermes-style calls in text, or None
    when it holds none, or one that is not {"name": str, "arguments": ...} JSON (then it is all content)."""
    if _START not in text:
        return None
    calls = []
    for closed, unclosed in _HERMES.findall(text):
        try:
            obj = json.loads(closed or unclosed)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            return None
        calls.append(Call(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    return text[:text.index(_START)] or None, calls


def required_calls(text: str) -> list[Call] | None:
    """The calls of "required"'s JSON array of {"name", "parameters"}, or None when text is not one (cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i for i in items):
        return None
    return [Call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex     # vLLM's form


@dataclass(slots=True)
class ToolPlan:
    """How one chat request's answers show tool calls. mode: "auto", "required" or "named"."""

    mode: str
    name: str | None = None         # the named function
    parallel: bool = True           # false: only the first call is answered

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
        """body's plan (None: tool_choice "none", plain text) on a server whose auto tool choice uses `parser`
        (None: auto is not enabled: a 400, as vLLM). "auto" keeps special tokens in the text (vLLM's hermes
        parser does the same)."""
        mode = body.choice_name()
        if mode == "none":
            return None
        if mode == "auto" and parser is None:
            why = "tool_choice is 'auto' (the default when tools are given)" if body.tool_choice is None else \
                "tool_choice='auto'"
            raise APIError(400, f"{why} needs the server started with --enable-auto-tool-choice and "
                                f"--tool-call-parser; pass tool_choice 'none', 'required' or a named function "
                                f"instead", "tool_choice")
        if mode == "auto":
            body.skip_special_tokens = False
        return cls(mode, body.tool_choice.function.name if mode == "named" else None, body.parallel_tool_calls)

    def calls(self, text: str) -> tuple[str | None, list[Call]] | None:
        """(content, calls) that text makes, or None when it makes no call (then it is all content)."""
        if self.mode == "named":
            found = ("", [Call(self.name, text)])
        elif self.mode == "required":
            found = None if (calls := required_calls(text)) is None else ("", calls)
        else:
            found = hermes_calls(text)
        if found is not None and not self.parallel:
            found = (found[0], found[1][:1])
        return found

    def finish_reason(self, found: bool, finish: str | None) -> str | None:
        """OpenAI's: "tool_calls" when "auto" found calls, or "required" ended by itself; else the engine's."""
        if found and (self.mode == "auto" or (self.mode == "required" and finish == "stop")):
            return "tool_calls"
        return finish

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The unstreamed answer: (message, finish_reason)."""
        found = self.calls(text)
        if found is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = found
        return ({"role": "assistant", "content": content, "tool_calls": [
            {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]}, self.finish_reason(True, finish))

    def stream(self) -> ToolStream:
        return ToolStream(self)


@dataclass(slots=True)
class ToolStream:
    """One streamed choice's deltas under a plan: `add` each piece of text as it comes (final: the choice has
    ended), then `finish_reason`."""

    plan: ToolPlan
    held: str = ""              # text not sent yet, that may be (part of) calls
    named_id: str | None = None     # the named function's call id, once its first delta went
    found: bool = False
    parts: list[str] = field(default_factory=list)      # every piece: the whole text, to decide at the end

    def add(self, piece: str, final: bool) -> dict:
        """The delta for this piece: {"content": ...}, {"tool_calls": [...]}, or {} (nothing to send yet)."""
        plan = self.plan
        self.parts.append(piece)
        if plan.mode == "named":
            if not piece and (self.named_id is not None or not final):
                return {}
            call = {"index": 0, "function": {"arguments": piece}}
            if self.named_id is None:
                self.named_id = call_id()
                call = {"index": 0, "id": self.named_id, "type": "function",
                        "function": {"name": plan.name, "arguments": piece}}
            self.found = True
            return {"tool_calls": [call]}
        self.held += piece
        sent = ""
        if plan.mode == "auto" and _START not in self.held:     # send all but a tail that may start a call
            keep = next((k for k in range(min(len(_START) - 1, len(self.held)), 0, -1)
                         if _START.startswith(self.held[-k:])), 0)
            sent, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        elif plan.mode == "auto":
            at = self.held.index(_START)
            sent, self.held = self.held[:at], self.held[at:]
        if not final:
            return {"content": sent} if sent else {}
        found = plan.calls("".join(self.parts))
        if found is None:
            rest, self.held = sent + self.held, ""
            return {"content": rest} if rest else {}
        self.found, self.held = True, ""
        delta = {"content": sent} if sent else {}
        return delta | {"tool_calls": [{"index": k, "id": call_id(), "type": "function",
                                        "function": {"name": c.name, "arguments": c.arguments}}
                                       for k, c in enumerate(found[1])]}

    def finish_reason(self, finish: str | None) -> str | None:
        return self.plan.finish_reason(self.found, finish)
