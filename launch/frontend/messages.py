"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as vLLM 0.32 serves it: the request
becomes a chat completion (`MessagesRequest.chat`), which runs as any other (the same template, parsers,
structured outputs and 400s), and its answer becomes a message: a thinking block (with a --reasoning-parser), a
text block, then a tool_use block per call.

Request: `system` (a string or text blocks) is the first system message; each message's content a string or
blocks: text, tool_use (an assistant turn's call: its input as JSON arguments), tool_result (a user turn's: a tool
message for its tool_use_id, before the turn's text, as vLLM orders them; its content a string or text blocks
joined by newlines), thinking and redacted_thinking (dropped, as the chat templates drop an earlier turn's
reasoning). Images and documents are not served (a 400 naming the block), nor server tools. `max_tokens`
(required), `stop_sequences`, `temperature`, `top_p`, `top_k` are chat's; tools are functions (their
`input_schema` the parameters); tool_choice auto, any (chat's "required"), tool (a named function) or none, and
`disable_parallel_tool_use` (parallel_tool_calls false); thinking disabled is reasoning_effort "none" (qwen3's and
glm45's parsers then read no thinking; deepseek_r1's always does), enabled or adaptive leave the model as it is;
output_config's json_schema format is chat's response_format and its effort reasoning_effort (vLLM's). vLLM's
sampling extras (responses.PASSED) pass through.
Answer: id "msg_...", stop_reason (`stop_reason`, vLLM's rules) "max_tokens", "tool_use", "stop_sequence" with the
stop string, or "end_turn"; usage in Anthropic's shape (cache_read_input_tokens: the chat usage's cached tokens,
which this server does not report yet: 0). An answer with no block has one empty text block (Anthropic's shape).
Streamed events: launch/frontend/message_events.py. Errors are Anthropic's {"type": "error", "error": {"type",
"message"}} (api_server's error handlers shape them so on /v1/messages).
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
    type: str | None = None     # "custom" or left out; Anthropic's server tools (web_search_..., ...) are not served
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
    output_config: dict | None = None   # format (json_schema: chat's response_format) and effort (reasoning_effort)
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
                elif kind == "tool_result" and turn.role == "user":     # a tool turn; the user's text follows it
                    content = block.get("content") or ""
                    messages.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, where),
                                     "content": content if isinstance(content, str) else _text(content, where,
                                                                                               "\n")})
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
        if server := [t for t in self.tools if t.type not in (None, "custom")]:
            raise APIError(400, f"tool {server[0].name!r} is a server tool ({server[0].type}), which is not served: "
                                f"send custom tools (name, description, input_schema)", "tools")
        body = {"model": self.model, "messages": self.conversation(),
                "max_tokens": 1 if self.max_tokens is None else self.max_tokens, "stream": self.stream and not counting}
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
        config = self.output_config or {}
        if isinstance(fmt := config.get("format"), dict) and fmt.get("type") == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                               "schema": fmt.get("schema")}}
        if config.get("effort") is not None:
            body["reasoning_effort"] = config["effort"]
        return ChatCompletionRequest.model_validate(body)

    def ignored_fields(self) -> list[str]:
        """As _Request's, less the fields that go to the chat completion (PASSED)."""
        return [f for f in super().ignored_fields() if f not in PASSED]


def _field(block: dict, name: str, kind: type, where: str):
    value = block.get(name)
    if not isinstance(value, kind):
        raise APIError(400, f"{where}.{name} must be a {kind.__name__}; got {value!r}", f"{where}.{name}")
    return value


def _block_text(block: dict, where: str) -> str:
    return _field(block, "text", str, where)


def _text(value, where: str, joint: str = "") -> str:
    """A string, or text blocks joined by `joint` (a 400 naming another block)."""
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
    return joint.join(parts)


def stop_reason(finish_reason: str | None, stop: int | str | None, arguments: list[str]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish and its calls' arguments (vLLM's rules):
    max_tokens when cut; tool_use when every call is whole (its arguments a JSON object); stop_sequence, with the
    stop string, when one ended it (a call it cut short must not run); tool_use for calls anyway; else end_turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if arguments and all(whole(a) for a in arguments):
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("tool_use" if arguments else "end_turn"), None


def usage(chat_usage: dict | None) -> dict:
    """Chat's usage in Anthropic's shape: input_tokens less the cached ones, which cache_read_input_tokens counts."""
    if chat_usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def arguments_of(text: str) -> dict | None:
    """A call's JSON arguments as tool_use's input: an object, or None when they are not one (a cut call's)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def whole(arguments: str) -> bool:
    return arguments_of(arguments) is not None


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
                 "input": arguments_of(c["function"]["arguments"]) or {}} for c in calls]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                                   [c["function"]["arguments"] for c in calls])
    return shell(model) | {"content": content or [{"type": "text", "text": ""}], "stop_reason": reason,
                           "stop_sequence": sequence, "usage": usage(completion.get("usage"))}


def error_body(e: APIError) -> dict:
    """An error in Anthropic's shape."""
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
            429: "rate_limit_error", 503: "overloaded_error"}.get(e.status, "api_error" if e.status >= 500 else e.kind)
    return {"type": "error", "error": {"type": kind, "message": e.message}}
