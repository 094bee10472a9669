"""GPT-OSS's harmony format in chat answers: vLLM's --reasoning-parser openai_gptoss and --tool-call-parser openai,
which vLLM allows only together (or one alone) and which read the same messages.

A GPT-OSS output is a run of messages, the first one's header begun by the prompt ("<|start|>assistant"):
    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
and a call is a message to a function: "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}"
(the recipient may also stand before the channel). A message's text ends at <|end|>, <|call|> or <|return|> (the
last two are EOS ids of GPT-OSS, so they end the output), or where the output ends. As vLLM's HarmonyParser:
  - analysis messages are the reasoning (with openai_gptoss; dropped without it), joined with "\n";
  - final messages, and commentary ones to no recipient (preambles), are the content, joined with "\n";
  - a message to a function (a recipient "functions.NAME", or any other that is not a built-in tool (python,
    browser, container) or "assistant") is a call of NAME (with openai and tool_choice "auto"; dropped without),
    its arguments the message's JSON re-written (json.dumps), or its text when it is not JSON or its content type
    names something other than json; finish_reason "tool_calls". Messages of other roles or recipients are dropped.
  - An output with no whole header (e.g. a grammar forced plain JSON) is all content. A header cut short after
    whole messages is dropped (vLLM answers its raw text).
usage.completion_tokens_details.reasoning_tokens counts the text tokens (not special ones, such as an EOS) of
analysis messages and of commentary messages to a recipient (vLLM's count).
Streamed: reasoning and content stream as they come, a tail that may begin a marker held back. A call opens (its
id and name) when its header ends, and its arguments follow as they are written, re-written as the unstreamed
answer writes them (launch/frontend/json_prefix.py), as vLLM streams them; a call's text that is not JSON after
all sends the rest at its end only when it extends what went out (else it is logged).
A named or "required" tool choice is answered as on other models (launch/frontend/tools.py): its grammar binds
from the first token, so the model writes no harmony header there.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from .call_stream import rest_of
from .json_prefix import JsonPrefix
from .reasoning import HARMONY as REASONING_PARSER
from .text import GrowingCounts, tag_overlap
from .tool_parsers import HARMONY as TOOL_PARSER
from .tool_parsers import Call
from .tools import ToolPlan

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)     # tokens the tokenizer must have (serve.py checks)
BUILTIN = ("python", "browser", "container")


@functools.lru_cache(maxsize=4)      # per tokenizer: its vocabulary is built anew on each get_vocab()
def marker_ids(tok) -> tuple[dict[int, str], frozenset[int]]:
    """(the markers' ids -> the markers, the tokenizer's other special ids)."""
    vocab = tok.get_vocab()
    return {vocab[m]: m for m in MARKERS}, frozenset(getattr(tok, "all_special_ids", ()))


def require_tokens(tok, model: str) -> None:
    """ValueError naming the model unless tok has every harmony marker as one token."""
    vocab = tok.get_vocab() if tok is not None else {}
    if missing := [m for m in MARKERS if m not in vocab]:
        raise ValueError(f"the harmony parsers ({REASONING_PARSER}, {TOOL_PARSER}) need GPT-OSS's tokens, and "
                         f"{model!r} lacks {', '.join(missing)}")


@dataclass(frozen=True, slots=True)
class Header:
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None

    @classmethod
    def of(cls, text: str) -> Header:
        """A message header as written before <|message|> (its <|start|> and role may be left out: assistant)."""
        before, has_channel, after = text.removeprefix(START).partition(CHANNEL)
        head, tail = before.replace(CONSTRAIN, " ").split(), after.replace(CONSTRAIN, " ").split()
        recipient = next((w[len("to="):] for w in head + tail if w.startswith("to=")), None) or None
        rest = [w for w in tail[1:] if not w.startswith("to=")]
        return cls(next((w for w in head if not w.startswith("to=")), "assistant"),
                   tail[0] if has_channel and tail else None, recipient, rest[-1] if rest else None)

    @property
    def kind(self) -> str:
        """"call", "reasoning", "content" or "drop" (vLLM's rules for chat)."""
        if self.role != "assistant":
            return "drop"
        r = self.recipient
        if r and not r.startswith("<|") and r not in ("assistant", "functions.") and r.split(".", 1)[0] not in BUILTIN:
            return "call"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel == "final" or (self.channel == "commentary" and r is None):
            return "content"
        return "drop"

    def call(self, text: str) -> Call:
        """The call whose message holds text."""
        arguments = text
        if self.content_type is None or "json" in self.content_type:
            try:
                arguments = json.dumps(json.loads(text))
            except (ValueError, RecursionError):
                pass
        return Call(self.recipient.removeprefix("functions."), arguments)


PLAIN = Header("assistant", "final", None, None)     # an output with no whole header reads as one final message


def _body_end(text: str) -> tuple[int, int]:
    """(where a message's text ends in text, -1 when it has not; the end marker's length)."""
    found = [(i, len(e)) for e in ENDS if (i := text.find(e)) >= 0]
    return min(found) if found else (-1, 0)


def messages(text: str) -> list[tuple[Header, str]] | None:
    """text's messages, (header, text) each, the last maybe cut short; None when it has no whole header."""
    out = []
    while (head := text.find(MESSAGE)) >= 0:
        header, text = Header.of(text[:head]), text[head + len(MESSAGE):]
        end, skip = _body_end(text)
        out.append((header, text if end < 0 else text[:end]))
        if end < 0:
            break
        text = text[end + skip:]
    return out or None


@dataclass(slots=True)
class HarmonyAnswer:
    """A GPT-OSS chat choice's answer; the interface of launch/frontend/answer.py's ChatAnswer."""

    parsed: bool        # analysis is parsed at all (openai_gptoss): the answer has a reasoning field
    include: bool       # include_reasoning: it is shown (and the logprobs, which would show it)
    tools: ToolPlan | None    # calls are answered ("auto" under openai)
    decode: Callable[[list[int]], str] = lambda ids: ""     # token ids -> text with the markers (reasoning_tokens)
    ids: dict[int, str] = field(default_factory=dict)       # the markers' token ids -> the markers
    special: frozenset[int] = frozenset()    # the tokenizer's other special ids (EOS): no text
    counted: GrowingCounts | None = None     # usage_details' counts so far

    keeps_special_tokens = True     # the markers are special tokens of GPT-OSS's tokenizer

    @classmethod
    def of(cls, body, tools: ToolPlan | None, reasoning_parser: str | None, tool_parser: str | None,
           tok) -> HarmonyAnswer | None:
        """body's answer when the server runs a harmony parser and tool_choice is not named or "required" (those
        are answered as on other models); else None."""
        if (reasoning_parser != REASONING_PARSER and tool_parser != TOOL_PARSER) or (tools and tools.mode != "auto"):
            return None
        return cls(reasoning_parser == REASONING_PARSER, body.include_reasoning,
                   tools if tool_parser == TOOL_PARSER else None,
                   lambda ids: tok.decode(ids, skip_special_tokens=False), *marker_ids(tok))

    @property
    def reasoning(self) -> bool:
        """The answer shows the analysis."""
        return self.parsed and self.include

    @property
    def shows_logprobs(self) -> bool:
        """False under include_reasoning false (vLLM's, with either harmony parser): they would show the analysis."""
        return self.include

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The unstreamed answer: (message, finish_reason)."""
        parts = {"reasoning": [], "content": [], "call": []}
        for header, body in messages(text) or [(PLAIN, text)]:
            if (kind := header.kind) == "call":
                parts[kind].append(header.call(body))
            elif kind != "drop" and body:
                parts[kind].append(body)
        message = {"role": "assistant", "content": "\n".join(parts["content"]) or None}
        if calls := self._answered(parts["call"], 0):
            message["tool_calls"] = [c.answer(self.tools.parser.call_id()) for c in calls]
        if self.parsed:
            message["reasoning"] = ("\n".join(parts["reasoning"]) or None) if self.reasoning else None
        return message, self.tools.finish_reason(True, finish) if calls else finish

    def _answered(self, calls: list[Call], before: int) -> list[Call]:
        """The calls answered of these, `before` having been answered already (none without openai's "auto"; the
        first only under parallel_tool_calls false)."""
        if self.tools is None:
            return []
        return calls if self.tools.parallel else calls[:max(0, 1 - before)]

    def usage_details(self, outputs: list[list[int]]) -> dict:
        """usage's completion_tokens_details ({}: without openai_gptoss). A growing output (a stream's, with
        continuous_usage_stats) is counted on from where the last call left it, not from its start."""
        if not self.parsed:
            return {}
        if self.counted is None:
            self.counted = GrowingCounts(lambda ids: _Count(ids, self))
        return {"completion_tokens_details": {"reasoning_tokens": self.counted.total(outputs)}}

    def num_tokens(self, ids: list[int]) -> int:
        """The text tokens of analysis messages and of commentary messages to a recipient (vLLM's count)."""
        return _Count(ids, self).advance()

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self)


@dataclass(slots=True)
class _Count:
    """HarmonyAnswer.num_tokens' count over one output, resumable: `advance` reads the ids added since."""

    ids: list[int]
    answer: HarmonyAnswer
    pos: int = 0                # ids read
    count: int = 0
    header: list[int] | None = field(default_factory=list)     # the ids of the header being read (None: in a text)
    counts: bool = False        # the text being read is counted

    def advance(self) -> int:
        answer = self.answer
        for t in self.ids[self.pos:]:
            marker = answer.ids.get(t)
            if self.header is not None:
                if marker == MESSAGE:
                    h = Header.of(answer.decode(self.header))
                    self.counts = h.channel == "analysis" or (h.channel == "commentary" and h.recipient is not None)
                    self.header = None
                else:
                    self.header.append(t)
            elif marker in ENDS:
                self.header = []
            elif marker is None and self.counts and t not in answer.special:
                self.count += 1
        self.pos = len(self.ids)
        return self.count


@dataclass(slots=True)
class HarmonyStream:
    """One streamed choice: `add` each piece of text (final: the choice has ended) -> its delta, then
    `finish_reason`. Says what HarmonyAnswer.message says."""

    answer: HarmonyAnswer
    held: str = ""
    header: Header | None = None    # the message being read (None: a header is)
    headed: bool = False            # a whole header came
    began: dict = field(default_factory=dict)     # kind -> a message of it sent text (the next is joined by "\n")
    opened: bool = False            # this message sent text
    call_text: list[str] = field(default_factory=list)     # this call's text so far, in pieces
    num_calls: int = 0              # calls opened
    sent: list[str] | None = None   # the open call's arguments that went out, in pieces (None: not answered)
    args: JsonPrefix | None = None  # what of its text is sure to begin its arguments (None: its text as written)

    def add(self, piece: str, final: bool) -> dict:
        self.held += piece
        delta = {}
        while True:
            if self.header is None:
                if (at := self.held.find(MESSAGE)) < 0:
                    break
                self.header, self.held, self.headed, self.opened = Header.of(self.held[:at]), \
                    self.held[at + len(MESSAGE):], True, False
                if self.header.kind == "call":
                    self._open(delta)
                continue
            end, skip = _body_end(self.held)
            if end < 0:
                cut = len(self.held) - (0 if final else tag_overlap(self.held, *ENDS))
                self._text(delta, self.held[:cut])
                self.held = self.held[cut:]
                if final:
                    self._close(delta)
                break
            self._text(delta, self.held[:end])
            self._close(delta)
            self.held, self.header = self.held[end + skip:], None
        if final and not self.headed and self.held:     # no whole header: all content
            self.header = PLAIN
            self._text(delta, self.held)
        return delta

    def _open(self, delta: dict) -> None:
        """A call's header came: its first delta, when the answer answers it."""
        if not self.answer._answered([self.header], self.num_calls):
            return
        first = self.header.call("").answer(self.answer.tools.parser.call_id(), index=self.num_calls)
        delta.setdefault("tool_calls", []).append(first)
        self.num_calls += 1
        kind = self.header.content_type
        self.sent, self.args = [], JsonPrefix(ascii=True) if kind is None or "json" in kind else None

    def _arguments(self, delta: dict, text: str) -> None:
        if text:
            calls = delta.setdefault("tool_calls", [])
            if calls and calls[-1]["index"] == self.num_calls - 1:
                calls[-1]["function"]["arguments"] += text
            else:
                calls.append({"index": self.num_calls - 1, "function": {"arguments": text}})
            self.sent.append(text)

    def _text(self, delta: dict, text: str) -> None:
        kind = self.header.kind
        if kind == "call":
            self.call_text.append(text)
            if self.sent is not None:
                self._arguments(delta, self.args.feed(text) if self.args is not None else text)
            return
        if not text or kind == "drop" or (kind == "reasoning" and not self.answer.reasoning):
            return
        if not self.opened and self.began.get(kind):
            text = "\n" + text
        self.began[kind] = self.opened = True
        delta[kind] = delta.get(kind, "") + text

    def _close(self, delta: dict) -> None:
        if self.header.kind != "call" or self.sent is None:
            return
        self._arguments(delta, rest_of(self.header.call("".join(self.call_text)), self.num_calls - 1,
                                       "".join(self.sent)))
        self.call_text, self.sent, self.args = [], None, None

    def finish_reason(self, finish: str | None) -> str | None:
        return self.answer.tools.finish_reason(True, finish) if self.num_calls else finish
