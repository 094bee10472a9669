"""OpenAI's Responses API (POST /v1/responses), as vLLM serves it for models with a chat template: the request
becomes a chat completion (`ResponsesRequest.chat`), which runs as any other, and its answer becomes a response:
the reasoning (with a --reasoning-parser), then the text, then each function call, as output items.

Input: a string (one user message) or items: messages (role user, system, developer or assistant; content a string
or input_text/output_text parts), function_call items (an earlier call: an assistant turn's tool call) and
function_call_output items (its result: a tool turn); reasoning items are dropped, as the chat templates drop earlier
reasoning. `instructions` become a system message first. Function tools (the Responses API's flat form) are chat's
tools; tool_choice and parallel_tool_calls are chat's; `text.format` json_schema or json_object is chat's
response_format; `reasoning.effort` is chat's reasoning_effort; max_output_tokens is max_tokens.
The response: status "completed", or "incomplete" with incomplete_details.reason "max_output_tokens" when the
output was cut; usage in the Responses shape (input_tokens, output_tokens, their details).
Streamed: launch/frontend/response_events.py turns the chat completion's chunks into the Responses API's events.
vLLM's sampling fields (logit_bias, top_k, min_p, the penalties, seed, stop, stop_token_ids, ignore_eos, ...;
PASSED) go to the chat completion as they are. `store` and `previous_response_id`: launch/frontend/response_store.py.
Not served (a 400 naming the field): background, prompt templates, max_tool_calls, top_logprobs; built-in tools (web
search, file search, ...) are not function tools, so they fail validation.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import Field

from .chat import ChatCompletionRequest
from .protocol import APIError, _Request

# vLLM's sampling fields on /v1/responses: they go to the chat completion as they are (which checks them)
PASSED = ("logit_bias", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
          "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "cache_salt",
          "include_reasoning", "priority")


def field_of(param: str | None) -> str | None:
    """The Responses field a chat field (a 400's param) came from, so the 400 names what the client sent."""
    head, _, rest = (param or "").partition(".")
    if head == "tools" and ".function." in f".{rest}.":        # tools.N.function.X -> tools.N.X
        return "tools." + rest.replace("function.", "", 1).rstrip(".")
    named = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
             "reasoning_effort": "reasoning.effort", "tool_choice": "tool_choice"}
    return named.get(head, param)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Part(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: str


def _joined(value: str | list[Part]) -> str:
    """A string, or text parts joined."""
    return value if isinstance(value, str) else "".join(p.text for p in value)


class Message(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]

    def text(self) -> str:
        return _joined(self.content)


class FunctionCall(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]

    def text(self) -> str:
        return _joined(self.output)


class Reasoning(_Request):
    type: Literal["reasoning"]


class FunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


class Format(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Request):
    format: Format | None = None


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


Item = Annotated[Message | FunctionCall | FunctionCallOutput | Reasoning, Field(union_mode="left_to_right")]


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = None        # these three: the chat completion checks them
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True             # false where the server keeps none (the route sets it)
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    background: bool = False
    prompt: dict | None = None
    max_tool_calls: int | None = None
    top_logprobs: int = 0
    truncation: Literal["auto", "disabled"] | None = "disabled"

    def refused(self) -> tuple[str, str] | None:
        """(the field, why) of the first thing set that this server does not serve."""
        if self.background:
            return "background", "background responses are not served; leave background out"
        if self.prompt is not None:
            return "prompt", "prompt templates are not served; send input (and instructions)"
        if self.max_tool_calls is not None:
            return "max_tool_calls", "max_tool_calls is not served; leave it out"
        if self.top_logprobs:
            return "top_logprobs", "logprobs are not served on /v1/responses; use /v1/chat/completions"
        if self.truncation == "auto":
            return "truncation", "truncation 'auto' is not served; shorten the input"
        return None

    def messages(self, previous: list[dict] = ()) -> list[dict]:
        """The conversation without the instructions: previous (the one previous_response_id continues; its dicts
        are not changed), then the input as chat messages."""
        messages, known = list(previous), {c["id"] for m in previous for c in m.get("tool_calls", ())}
        items = [Message(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, Message):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCall):
                if item.call_id in known:
                    raise APIError(400, f"function_call {item.call_id!r} is in the conversation "
                                        f"previous_response_id continues already; send only the new items (its "
                                        f"function_call_output)", "input")
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":     # that turn's text, then its calls
                    messages[-1] = messages[-1] | {"tool_calls": [*messages[-1].get("tool_calls", ()), call]}
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return messages

    def chat(self, conversation: list[dict] | None = None) -> ChatCompletionRequest:
        """The chat completion this request runs as; conversation: `messages(previous)` when it continues a stored
        one (None: its input alone)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += self.messages() if conversation is None else conversation
        if not messages:
            raise APIError(400, "input holds no message; send at least one", "input")
        body = {"model": self.model, "messages": messages, "stream": self.stream,
                "parallel_tool_calls": self.parallel_tool_calls}
        body |= {k: v for k, v in (self.model_extra or {}).items() if k in PASSED}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name in ("max_tokens", "temperature", "top_p"):
            value = getattr(self, "max_output_tokens" if name == "max_tokens" else name)
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else {
                "type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice not in ("auto", "none"):
            raise APIError(400, "tool_choice names a tool, and tools is empty; pass the functions in tools",
                           "tool_choice")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError(400, "text.format json_schema needs a schema", "text.format.schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return ChatCompletionRequest.model_validate(body)

    def ignored_fields(self) -> list[str]:
        """As _Request's, less the fields that go to the chat completion (PASSED)."""
        return [f for f in super().ignored_fields() if f not in PASSED]

    def shell(self, model: str) -> dict:
        """The response object's fields that echo the request (OpenAI's Response), before output and usage."""
        fmt = self.text.format.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format else {
            "type": "text"}
        if fmt["type"] == "json_schema":
            fmt.setdefault("name", "output")      # the name it ran under
        return {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
                "status": "in_progress", "error": None, "incomplete_details": None, "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens, "metadata": self.metadata or {}, "output": [],
                "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": self.previous_response_id,
                "reasoning": self.reasoning.model_dump() if self.reasoning else None, "store": self.store,
                "temperature": self.temperature, "top_p": self.top_p, "text": {"format": fmt},
                "tool_choice": self.tool_choice if isinstance(self.tool_choice, str) else
                self.tool_choice.model_dump(), "tools": [t.model_dump(exclude_none=True) for t in self.tools],
                "truncation": self.truncation or "disabled", "user": self.user, "background": False, "usage": None}


def usage(chat_usage: dict | None) -> dict | None:
    """Chat's usage in the Responses shape."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},     # writes: not counted
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat_usage["total_tokens"]}


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(text: str, status: str = "completed") -> dict:
    return {"id": _id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": _id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def finish(response: dict, finish_reason: str | None, chat_usage: dict | None) -> dict:
    """response, completed (or incomplete: cut by max_output_tokens, and its last item with it, as OpenAI's), with
    its usage."""
    cut = finish_reason == "length"
    if cut and response["output"]:
        response["output"][-1]["status"] = "incomplete"
    return response | {"status": "incomplete" if cut else "completed", "usage": usage(chat_usage),
                       "incomplete_details": {"reason": "max_output_tokens"} if cut else None}


def answer(request: ResponsesRequest, model: str, completion: dict) -> dict:
    """The response to a chat completion's answer."""
    choice = completion["choices"][0]
    message, output = choice["message"], []
    if message.get("reasoning"):
        output.append(reasoning_item(message["reasoning"]))
    if message.get("content"):
        output.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return finish(request.shell(model) | {"output": output}, choice["finish_reason"], completion.get("usage"))
