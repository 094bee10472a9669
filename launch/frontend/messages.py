"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as vLLM 0.32 serves it: the request
becomes a chat completion (`MessagesRequest.chat`), which runs as any other (the same template, parsers,
structured outputs and 400s), and its answer becomes a message: a thinking block (with a --reasoning-parser), a
text block, then a tool_use block per call.

Request: `system` (a string or text blocks) is the first system message; each message's content a string or
blocks: text, tool_use (an assistant turn's call: its input as JSON arguments), tool_result (a user turn's: a tool
message for its tool_use_id, its content a string or text blocks), thinking and redacted_thinking (dropped, as the
chat templates drop an earlier turn's reasoning). Images and documents are not served (a 400 naming the block).
`max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k` are chat's; tools are functions (their
`input_schema` the parameters); tool_choice auto, any (chat's "required"), tool (a named function) or none, and
`disable_parallel_tool_use` (parallel_tool_calls false); thinking disabled is reasoning_effort "none" (the
reasoning parsers then read no thinking), enabled or adaptive leave the model as it is. vLLM's sampling extras
(responses.PASSED) pass through.
Answer: id "msg_...", stop_reason "max_tokens" (cut), "tool_use" (calls), "stop_sequence" with the stop string, or
"end_turn"; usage's input_tokens exclude the prompt tokens found in the prefix cache (cache_read_input_tokens), as
Anthropic counts them. An answer with no block has one empty text block (Anthropic's shape). Streamed events:
launch/frontend/message_events.py. Errors are Anthropic's {"type": "error", "error": {"type", "message"}}.
"""
from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import Field

from .chat import ChatCompletionRequest
from .protocol import APIError, _Request
from .responses import PASSED


class Tool(_Request):
    name: str
    description: str | None = None
    input_schema: dict = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class Turn(_Request):
    role: Literal["user", "assistant"]
    content: str | list[dict]


class MessagesRequest(_Request):
    model: str | None = None
    messages: list[Turn]
    max_tokens: int | None = None       # required by Anthropic, and here (a 400 naming it)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict | None = None

    def conversation(self) -> list[dict]:
        """The chat messages: the system text first, then each turn's."""
        system = _text(self.system, "system") if self.system is not None else ""
        messages = [{"role": "system", "content": system}] if system else []
        for i, turn in enumerate(self.messages):
            if isinstance(turn.content, str):
                messages.append({"role": turn.role, "content": turn.content})
                continue
            texts, calls = [], []
            for j, block in enumerate(turn.content):
                where, kind = f"messages.{i}.content.{j}", block.get("type")
                if kind == "text":
                    texts.append(_block_text(block, where))
                elif kind == "tool_use" and turn.role == "assistant":
                    calls.append({"id": _field(block, "id", str, where), "type": "function", "function": {
                        "name": _field(block, "name", str, where), "arguments": json.dumps(block.get("input") or {})}})
                elif kind == "tool_result" and turn.role == "user":
                    if texts:       # text before a result: its own user turn, in order
                        messages.append({"role": "user", "content": "".join(texts)})
                        texts = []
                    content = block.get("content", "")
                    messages.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, where),
                                     "content": content if isinstance(content, str) else _text(content, where)})
                elif kind not in ("thinking", "redacted_thinking"):
                    raise APIError(400, f"{where} is a {kind!r} block, which is not served on {turn.role} turns: send "
                                        f"text, tool_use (assistant), tool_result (user) or thinking blocks", where)
            if texts or calls:
                messages.append({"role": turn.role, "content": "".join(texts) or None}
                                | ({"tool_calls": calls} if calls else {}))
        return messages

    def chat(self, counting: bool = False) -> ChatCompletionRequest:
        """The chat completion this request runs as (counting: only its prompt is wanted; max_tokens may be left
        out, as count_tokens' requests do)."""
        if self.max_tokens is None and not counting:
            raise APIError(400, "max_tokens is required (Anthropic's): pass the most tokens to generate",
                           "max_tokens")
        body = {"model": self.model, "messages": self.conversation(), "max_tokens": self.max_tokens or 1,
                "stream": self.stream and not counting}
        body |= {k: v for k, v in (self.model_extra or {}).items() if k in PASSED}
        if body["stream"]:      # every chunk's usage: message_start tells the prompt's tokens
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        for name, value in (("stop", self.stop_sequences), ("temperature", self.temperature), ("top_p", self.top_p),
                            ("top_k", self.top_k)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema}
                              | ({"description": t.description} if t.description else {})} for t in self.tools]
        if (choice := self.tool_choice) is not None:
            if choice.type == "tool" and not choice.name:
                raise APIError(400, "tool_choice type 'tool' needs the tool's name in tool_choice.name",
                               "tool_choice.name")
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None and self.thinking.type == "disabled":
            body["reasoning_effort"] = "none"
        return ChatCompletionRequest.model_validate(body)


def _field(block: dict, name: str, kind: type, where: str):
    value = block.get(name)
    if not isinstance(value, kind):
        raise APIError(400, f"{where}.{name} must be a {kind.__name__}; got {value!r}", f"{where}.{name}")
    return value


def _block_text(block: dict, where: str) -> str:
    return _field(block, "text", str, where)


def _text(value, where: str) -> str:
    """A string, or text blocks joined (a 400 naming another block)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", where)
    parts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(400, f"{where}.{j} is a {kind!r} block; only text blocks are served here", f"{where}.{j}")
        parts.append(_block_text(block, f"{where}.{j}"))
    return "".join(parts)


def stop_reason(finish_reason: str | None, stop: int | str | None, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish: max_tokens when cut, tool_use with calls,
    stop_sequence with the stop string that ended it, else end_turn (vLLM's rules)."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(chat_usage: dict | None) -> dict:
    """Chat's usage in Anthropic's shape: input_tokens less the cached ones, which cache_read_input_tokens counts."""
    if chat_usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def arguments_of(text: str) -> dict:
    """A call's JSON arguments as tool_use's input (an object; {} when they are not one, as a cut call's)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def shell(model: str) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None}


def answer(model: str, completion: dict) -> dict:
    """The message of a chat completion's answer."""
    choice = completion["choices"][0]
    message, content = choice["message"], []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": arguments_of(c["function"]["arguments"])} for c in calls]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(calls))
    return shell(model) | {"content": content or [{"type": "text", "text": ""}], "stop_reason": reason,
                           "stop_sequence": sequence, "usage": usage(completion.get("usage"))}


def error_body(e: APIError) -> dict:
    """An error in Anthropic's shape."""
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(e.status, e.kind)
    return {"type": "error", "error": {"type": kind, "message": e.message}}
