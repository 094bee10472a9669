"""A chat choice's answer: its text split into reasoning and content (launch/frontend/reasoning.py, with the server's
--reasoning-parser), and tool calls found in the content (launch/frontend/tools.py); one message unstreamed, or
deltas as text arrives. A chat without tools or a reasoning parser answers its text as content (no ChatAnswer).
GPT-OSS's harmony parsers answer through launch/frontend/harmony.py's HarmonyAnswer, which has the same interface."""
from __future__ import annotations

from dataclasses import dataclass

from . import harmony
from .reasoning import ReasoningCount, ReasoningPlan, ReasoningStream, require_think_tokens
from .text import GrowingCounts
from .tools import ToolPlan, ToolStream


def check_parsers(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """ValueError unless a harmony parser goes with the other one or none (vLLM's rule): both read one format."""
    pair = {"tool": tool_parser, "reasoning": reasoning_parser}
    wanted = {"tool": harmony.TOOL_PARSER, "reasoning": harmony.REASONING_PARSER}
    if any(pair[k] == wanted[k] for k in pair) and any(pair[k] not in (None, wanted[k]) for k in pair):
        raise ValueError(f"the tool call parser {tool_parser!r} and the reasoning parser {reasoning_parser!r} do "
                         f"not go together: GPT-OSS's harmony parsers ({harmony.TOOL_PARSER}, "
                         f"{harmony.REASONING_PARSER}) take each other or none")


def require_tokens(tok, tool_parser: str | None, reasoning_parser: str | None, model: str) -> None:
    """ValueError naming the model unless its tokenizer has the tokens the parsers read."""
    if harmony.TOOL_PARSER == tool_parser or harmony.REASONING_PARSER == reasoning_parser:
        harmony.require_tokens(tok, model)
    elif reasoning_parser is not None:
        require_think_tokens(tok, reasoning_parser, model)


@dataclass(slots=True)
class ChatAnswer:
    tools: ToolPlan | None = None
    reasoning: ReasoningPlan | None = None
    counted: GrowingCounts | None = None     # usage_details' counts so far

    @classmethod
    def of(cls, tools: ToolPlan | None, reasoning: ReasoningPlan | None) -> ChatAnswer | None:
        return None if tools is None and reasoning is None else cls(tools, reasoning)

    @property
    def keeps_special_tokens(self) -> bool:
        """The text keeps special tokens whatever skip_special_tokens says (a parser reads them)."""
        return (self.reasoning is not None and self.reasoning.special) or (
            self.tools is not None and self.tools.keeps_special_tokens)

    @property
    def shows_logprobs(self) -> bool:
        """False when the reasoning is hidden (include_reasoning false): the logprobs would show it."""
        return self.reasoning is None or self.reasoning.include

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The unstreamed answer: (message, finish_reason)."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        if self.tools is not None and (content is not None or self.tools.mode != "auto"):
            message, finish = self.tools.message(content or "", finish)
        else:     # no content (cut short while reasoning): null, as without tools
            message = {"role": "assistant", "content": content}
        if self.reasoning is not None:     # vLLM's field, null when hidden
            message["reasoning"] = reasoning if self.reasoning.include else None
        return message, finish

    def usage_details(self, outputs: list[list[int]]) -> dict:
        """usage's completion_tokens_details for these outputs' token ids ({}: no reasoning parser)."""
        if self.reasoning is None:
            return {}
        if self.counted is None:       # a stream's outputs grow: each is counted on from where it was
            self.counted = GrowingCounts(lambda ids: ReasoningCount(ids, self.reasoning))
        return {"completion_tokens_details": {"reasoning_tokens": self.counted.total(outputs)}}

    def stream(self) -> ChatAnswerStream:
        return ChatAnswerStream(self, self.reasoning.stream() if self.reasoning else None,
                                self.tools.stream() if self.tools else None)


@dataclass(slots=True)
class ChatAnswerStream:
    """One streamed choice: `add` each piece of text (final: the choice has ended) -> its delta, then
    `finish_reason`."""

    answer: ChatAnswer
    reasoning: ReasoningStream | None
    tools: ToolStream | None

    def add(self, piece: str, final: bool) -> dict:
        thought, piece = self.reasoning.add(piece, final) if self.reasoning is not None else ("", piece)
        if self.tools is not None:
            delta = self.tools.add(piece, final)
        else:
            delta = {"content": piece} if piece else {}
        if thought and self.answer.reasoning.include:
            delta = {"reasoning": thought} | delta
        return delta

    def finish_reason(self, finish: str | None) -> str | None:
        return self.tools.finish_reason(finish) if self.tools is not None else finish
