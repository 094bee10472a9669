"""Reasoning in chat answers, as vLLM's --reasoning-parser serves it: a thinking model writes its reasoning first,
up to "</think>", then its answer. The answer's `reasoning` field (vLLM 0.32's name) gets the first and `content`
the rest; tool calls are looked for in the rest only (launch/frontend/answer.py puts the two together).

Parsers (both need "<think>" and "</think>" to be tokens of the model's tokenizer; serve.py checks):
  deepseek_r1  DeepSeek-R1 (its chat template opens "<think>" in the prompt): the output is reasoning up to its
               first "</think>", and all reasoning when there is none (cut short); a "<think>" that opens the
               output is dropped.
  qwen3        Qwen3: the same, unless the request's chat_template_kwargs say enable_thinking false, or its
               reasoning_effort is "none" (its template then closes the thinking in the prompt): all content.
include_reasoning false (vLLM's): the answer leaves the reasoning out, and the logprobs too (they would show it).
Structured outputs (and a named or required tool choice) bind once the reasoning has ended, as vLLM's do: the
engine leaves the tokens up to "</think>" free (SamplingParams.reasoning_end_token_id).
usage.completion_tokens_details.reasoning_tokens: the output tokens before "</think>" (all without one; vLLM's
deepseek_r1 counts only tokens between a "<think>" and a "</think>" of the output, 0 when the prompt opened it).

Streamed: deltas carry `reasoning` until "</think>" comes, then `content`; an opening that may still be "<think>"
and a tail that may begin "</think>" are held back until known, so the stream says what the unstreamed answer says.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .text import tag_overlap

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"
QWEN3_TURNS = ("<|im_start|>", "<|im_end|>")    # earlier turns end at these (qwen3's gate looks no further back)


@functools.lru_cache(maxsize=4)      # per tokenizer: its vocabulary is built anew on each get_vocab()
def think_tokens(tok) -> tuple[int, int, bool] | None:
    """(the ids of "<think>" and "</think>", whether decoding that skips special tokens drops either) for tok, or
    None unless both are single tokens of its vocabulary (None too for no tokenizer)."""
    vocab = tok.get_vocab() if tok is not None else {}
    ids = vocab.get(START), vocab.get(END)
    if None in ids:
        return None
    return (*ids, any(tok.decode([i], skip_special_tokens=True) == "" for i in ids))


def require_think_tokens(tok, parser: str, model: str) -> tuple[int, int, bool]:
    """think_tokens(tok), or ValueError naming the parser and the model when tok lacks them (or there is none)."""
    found = think_tokens(tok)
    if found is None:
        raise ValueError(f"--reasoning-parser {parser} needs the tokens <think> and </think> in the model's tokenizer, "
                         f"and {model!r} has " + ("no tokenizer" if tok is None else "no such tokens"))
    return found


@functools.lru_cache(maxsize=4)
def turn_ids(tok, parser: str) -> frozenset[int]:
    """The ids of the tokens that end a turn for `parser`'s gate (qwen3's ChatML markers; none for deepseek_r1)."""
    vocab = tok.get_vocab() if parser == "qwen3" else {}
    return frozenset(vocab[t] for t in QWEN3_TURNS if t in vocab)


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
    turns: frozenset[int] = frozenset()     # the gate's look back stops at these (qwen3: ChatML turn markers)

    @classmethod
    def of(cls, body, parser: str | None, tok) -> ReasoningPlan | None:
        """body's plan on a server with `parser` (None: no reasoning parser). A completions body has none of chat's
        thinking fields: thinking on, reasoning shown (only its structured outputs' gate matters there)."""
        if parser is None:
            return None
        found = require_think_tokens(tok, parser, "this model")    # attach() and serve.py checked it already
        kwargs, effort = getattr(body, "chat_template_kwargs", None) or {}, getattr(body, "reasoning_effort", None)
        thinking = parser == "deepseek_r1" or kwargs.get("enable_thinking", effort != "none") is not False
        return cls(thinking, getattr(body, "include_reasoning", True), *found, turn_ids(tok, parser))

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of an output's text; None: none."""
        if not self.thinking:
            return None, text
        if text.startswith(START):
            text = text[len(START):]
        reasoning, end, content = text.partition(END)
        return reasoning, (content or None) if end else None

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
        """Reasoning tokens of an output: those before its first "</think>" (all without one), "<think>" not."""
        if not self.thinking:
            return 0
        before = ids[:ids.index(self.end_id)] if self.end_id in ids else ids
        return len(before) - (1 if before and before[0] == self.start_id else 0)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


@dataclass(slots=True)
class ReasoningStream:
    """One streamed choice's split: `add` each piece of text (final: the choice has ended) -> (reasoning, content)."""

    plan: ReasoningPlan
    held: str = ""
    state: str = "start"       # "start" (the output may still open with "<think>"), "reasoning" or "content"

    def add(self, piece: str, final: bool) -> tuple[str, str]:
        if not self.plan.thinking or self.state == "content":
            return "", piece
        self.held += piece
        if self.state == "start":
            if START.startswith(self.held) and not final:
                return "", ""
            if self.held.startswith(START):
                self.held = self.held[len(START):]
            self.state = "reasoning"
        at = self.held.find(END)
        if at >= 0:
            self.state = "content"
            reasoning, content, self.held = self.held[:at], self.held[at + len(END):], ""
            return reasoning, content
        keep = 0 if final else tag_overlap(self.held, END)
        reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return reasoning, ""
