"""Reasoning in chat answers, as vLLM's --reasoning-parser serves it: a thinking model writes its reasoning first,
up to "</think>", then its answer. The answer's `reasoning` field (vLLM 0.32's name) gets the first and `content`
the rest; tool calls are looked for in the rest only (launch/frontend/answer.py puts the two together).

Parsers (each needs "<think>" and "</think>" to be tokens of the model's tokenizer; serve.py checks):
  deepseek_r1  DeepSeek-R1 (its chat template opens "<think>" in the prompt): the output is reasoning up to its
               first "</think>", and all reasoning when there is none (cut short); a "<think>" that opens the
               output is dropped.
  qwen3        Qwen3: the same, unless the request's chat_template_kwargs say enable_thinking false, or its
               reasoning_effort is "none" (its template then closes the thinking in the prompt): all content.
               As vLLM 0.32's: a "<tool_call>" ends the reasoning too (it begins the content, where the tool
               parser finds the call; not when a grammar binds the output, which it does after "</think>" only),
               the reasoning's trailing whitespace and any "<think>" in it are dropped, empty reasoning is null,
               and a "</think>" in the content is dropped (also inside a call's text, where vLLM keeps it). Not
               copied: glm45's "<think>" in the content opens reasoning again in vLLM.
  glm45        GLM-4.5 (and 4.6, 4.7): as qwen3, its thinking off when chat_template_kwargs say thinking or
               enable_thinking false (and neither true), or reasoning_effort is "none"; GLM's turn markers.
include_reasoning false (vLLM's): the answer leaves the reasoning out, and the logprobs too (they would show it).
Structured outputs (and a named or required tool choice) bind once the reasoning has ended, as vLLM's do: the
engine leaves the tokens up to "</think>" free (SamplingParams.reasoning_end_token_id).
A "<tool_call>" that ends qwen3's or glm45's reasoning does not bind them (vLLM's does): only "</think>" does.
usage.completion_tokens_details.reasoning_tokens: the output tokens before "</think>" (or qwen3's and glm45's
"<tool_call>"; all without one; vLLM's deepseek_r1 counts only tokens between a "<think>" and a "</think>" of the
output, 0 when the prompt opened it).

Streamed: deltas carry `reasoning` until "</think>" comes, then `content`; an opening that may still be "<think>",
a tail that may begin "</think>" (or "<tool_call>"), and under qwen3 and glm45 trailing whitespace are held back
until known, so the stream says what the unstreamed answer says.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .text import tag_overlap

START, END, TOOL_START = "<think>", "</think>", "<tool_call>"
# earlier turns end at these (the gate looks no further back)
TURNS = {"deepseek_r1": (), "qwen3": ("<|im_start|>", "<|im_end|>"),
         "glm45": ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")}
HARMONY = "openai_gptoss"     # GPT-OSS's analysis messages: launch/frontend/harmony.py reads them
PARSERS = (*TURNS, HARMONY)
ENGINE_RULES = ("qwen3", "glm45")    # vLLM 0.32's parser-engine rules (ReasoningPlan.engine)


def think_tokens(tok) -> tuple[int, int, bool] | None:
    """(the ids of "<think>" and "</think>", whether decoding that skips special tokens drops either) for tok, or
    None unless both are single tokens of its vocabulary (None too for no tokenizer)."""
    if tok is None:
        return None
    (start, start_dropped), (end, end_dropped) = token_of(tok, START), token_of(tok, END)
    return None if start is None or end is None else (start, end, start_dropped or end_dropped)


def require_think_tokens(tok, parser: str, model: str) -> tuple[int, int, bool]:
    """think_tokens(tok), or ValueError naming the parser and the model when tok lacks them (or there is none)."""
    found = think_tokens(tok)
    if found is None:
        raise ValueError(f"--reasoning-parser {parser} needs the tokens <think> and </think> in the model's tokenizer, "
                         f"and {model!r} has " + ("no tokenizer" if tok is None else "no such tokens"))
    return found


@functools.lru_cache(maxsize=4)
def turn_ids(tok, parser: str) -> frozenset[int]:
    """The ids of the tokens that end a turn for `parser`'s gate (its TURNS that tok has)."""
    vocab = tok.get_vocab() if TURNS[parser] else {}
    return frozenset(vocab[t] for t in TURNS[parser] if t in vocab)


@functools.lru_cache(maxsize=16)      # per tokenizer and text: its vocabulary is built anew on each get_vocab()
def token_of(tok, text: str) -> tuple[int | None, bool]:
    """(text's id when it is one token of tok's vocabulary, else None; whether decoding that skips special tokens
    drops it)."""
    i = tok.get_vocab().get(text)
    return i, i is not None and tok.decode([i], skip_special_tokens=True) == ""


def thinking_of(parser: str, kwargs: dict, effort: str | None) -> bool:
    """Whether a chat request under `parser` thinks, from its chat_template_kwargs and reasoning_effort ("none"
    turns thinking off unless the kwargs say otherwise; another effort sets enable_thinking true)."""
    enable = kwargs.get("enable_thinking", None if effort is None else effort != "none")
    if parser == "qwen3":
        return enable is not False
    if parser == "glm45":       # vLLM's: on unless a switch is given, then on when either is true
        switch = kwargs.get("thinking")
        return (switch is None and enable is None) or bool(switch) or bool(enable)
    return True


def gate_of(prompt: list[int], start_id: int, end_id: int, turns: frozenset[int] = frozenset()) -> int | None:
    """end_id, where a structured output binds (SamplingParams.reasoning_end_token_id), unless the prompt ended the
    thinking already: its last think token, looking back no further than a turn's end, is "</think>" (as a template
    that turns thinking off writes it; vLLM's check). None: the grammar binds from the first token."""
    for t in reversed(prompt):
        if t == end_id:
            return None
        if t == start_id or t in turns:
            return end_id
    return end_id


@dataclass(slots=True)
class ReasoningPlan:
    """How one chat request's answers split off their reasoning."""

    thinking: bool         # false: no reasoning, all content (qwen3 with enable_thinking false)
    include: bool          # include_reasoning: the answer shows it
    start_id: int
    end_id: int
    special: bool = False  # the tokenizer's skip_special_tokens would drop "<think>" or "</think>" from the text
    turns: frozenset[int] = frozenset()     # the gate's look back stops at these (TURNS)
    tool_start: str | None = None   # it ends the reasoning too, and begins the content (ENGINE_RULES)
    tool_start_id: int | None = None    # its id, when it is one token
    engine: bool = False    # vLLM's parser-engine rules (ENGINE_RULES): trailing whitespace and "<think>" dropped from
    # the reasoning, empty reasoning null, "</think>" dropped from the content

    @classmethod
    def of(cls, body, parser: str | None, tok) -> ReasoningPlan | None:
        """body's plan on a server with `parser` (None: no reasoning parser). A completions body has none of chat's
        thinking fields: thinking on, reasoning shown (only its structured outputs' gate matters there)."""
        if parser is None or parser == HARMONY:
            return None
        start_id, end_id, special = require_think_tokens(tok, parser, "this model")    # attach() and serve.py did
        kwargs, effort = getattr(body, "chat_template_kwargs", None) or {}, getattr(body, "reasoning_effort", None)
        engine = parser in ENGINE_RULES
        # a grammar (a structured output, a named or required tool choice) binds at "</think>" only: there a
        # "<tool_call>" is the reasoning's text, not its end (the answer would read unconstrained text as the
        # constrained output)
        ends_at_call = engine and (getattr(body, "structured", None) is None or body.structured()[0] is None)
        tool_id, tool_special = token_of(tok, TOOL_START) if ends_at_call else (None, False)
        return cls(thinking_of(parser, kwargs, effort), getattr(body, "include_reasoning", True), start_id, end_id,
                   special or tool_special, turn_ids(tok, parser), TOOL_START if ends_at_call else None, tool_id,
                   engine)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of an output's text; None: none."""
        if not self.thinking:
            return None, text
        if text.startswith(START):
            text = text[len(START):]
        at, skip = self.end_in(text)
        reasoning, content = (text, None) if at < 0 else (text[:at], text[at + skip:] or None)
        if not self.engine:
            return reasoning, content
        return reasoning.replace(START, "").rstrip() or None, content and content.replace(END, "") or None

    def end_in(self, text: str) -> tuple[int, int]:
        """(where the reasoning ends in text, -1 when it does not; the length of the marker that ends it and is
        dropped): at "</think>", or at the tool start (which stays, as the content's start)."""
        at, skip = text.find(END), len(END)
        if self.tool_start is not None and 0 <= (call := text.find(self.tool_start)) and (at < 0 or call < at):
            at, skip = call, 0
        return at, skip

    def gate(self, prompt: list[int]) -> int | None:
        """The token after which a structured output binds (SamplingParams.reasoning_end_token_id): `gate_of`'s,
        or None (from the first token) when thinking is off or the reasoning is not shown (include_reasoning false,
        as vLLM)."""
        if not self.thinking or not self.include:
            return None
        return gate_of(prompt, self.start_id, self.end_id, self.turns)

    def gated(self, params: list, prompts: list[list[int]]) -> list:
        """Each prompt's parameters, with reasoning_end_token_id set (`gate`) where it has structured outputs: they
        bind once that prompt's thinking has ended (chat's and, per prompt, completions' rule, as vLLM's)."""
        return [replace(p, reasoning_end_token_id=g) if p.structured_outputs and (g := self.gate(ids)) is not None
                else p for p, ids in zip(params, prompts)]

    def num_tokens(self, ids: list[int]) -> int:
        """Reasoning tokens of an output: those before its first "</think>" or tool start token (all without one),
        "<think>" not."""
        return ReasoningCount(ids, self).advance()

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


@dataclass(slots=True)
class ReasoningCount:
    """ReasoningPlan.num_tokens over one output, resumable (text.GrowingCounts): `advance` reads the ids added
    since."""

    ids: list[int]
    plan: ReasoningPlan
    pos: int = 0                # ids read
    end: int | None = None      # where the reasoning ended, once it has

    def advance(self) -> int:
        plan = self.plan
        if not plan.thinking:
            return 0
        if self.end is None:
            ends = (plan.end_id, plan.tool_start_id)
            self.end = next((i for i in range(self.pos, len(self.ids)) if self.ids[i] in ends), None)
        self.pos = len(self.ids)
        before = len(self.ids) if self.end is None else self.end
        return before - (1 if before and self.ids[0] == plan.start_id else 0)


@dataclass(slots=True)
class ReasoningStream:
    """One streamed choice's split: `add` each piece of text (final: the choice has ended) -> (reasoning, content)."""

    plan: ReasoningPlan
    held: str = ""
    state: str = "start"       # "start" (the output may still open with "<think>"), "reasoning" or "content"

    def add(self, piece: str, final: bool) -> tuple[str, str]:
        if not self.plan.thinking:
            return "", piece
        if self.state == "content":
            return "", self._content(piece, final)
        self.held += piece
        if self.state == "start":
            if START.startswith(self.held) and not final:
                return "", ""
            if self.held.startswith(START):
                self.held = self.held[len(START):]
            self.state = "reasoning"
        plan = self.plan
        at, skip = plan.end_in(self.held)
        if at >= 0:
            self.state = "content"
            reasoning, content, self.held = self.held[:at], self.held[at + skip:], ""
            return reasoning.replace(START, "").rstrip() if plan.engine else reasoning, self._content(content, final)
        # the held text stays as written: tags are found, and "<think>" dropped, in it as split() does in the whole
        tags = [END, *filter(None, [plan.tool_start]), *([START] if plan.engine else [])]
        cut = len(self.held) - (0 if final else tag_overlap(self.held, *tags))
        while plan.engine and cut:     # trailing whitespace (and "<think>"s) wait until more reasoning follows
            if self.held.endswith(START, 0, cut):
                cut -= len(START)
            elif self.held[cut - 1].isspace():
                cut -= 1
            else:
                break
        reasoning, self.held = self.held[:cut], self.held[cut:]
        return reasoning.replace(START, "") if plan.engine else reasoning, ""

    def _content(self, piece: str, final: bool) -> str:
        """Content text to send: under the engine rules without "</think>" (a part of one waits; the held text
        stays as written, so the drops are split()'s)."""
        if not self.plan.engine:
            return piece
        self.held += piece
        cut = len(self.held) - (0 if final else tag_overlap(self.held, END))
        out, self.held = self.held[:cut], self.held[cut:]
        return out.replace(END, "")
