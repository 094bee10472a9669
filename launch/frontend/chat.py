"""Chat completions' request shapes (POST /v1/chat/completions): messages, the chat template's options, tools and
the chat-only sampling fields; the fields shared with completions are protocol.py's `_Sampling`.

Tools (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`, as vLLM takes them) are checked here, and a named
function or "required" becomes the request's structured output (`tool_constraint`): the function's parameters
schema, or vLLM's schema of a JSON array of calls. What the answer looks like is launch/frontend/tools.py's."""
from __future__ import annotations

import json
import logging
from typing import Annotated, Literal

from pydantic import Field

from .protocol import APIError, NumLogprobs, _Request, _Sampling

logger = logging.getLogger("afserve.http")

Name = Annotated[str, Field(min_length=1)]
# OpenAI's deprecated function calling, which chat refuses (completions ignores them with a warning, as vLLM)
DEPRECATED = {"functions": "pass them as tools", "function_call": "pass tool_choice"}


def empty_object() -> dict:
    """The parameters schema of a function that declares none: it takes {}."""
    return {"type": "object", "properties": {}}


class TextPart(_Request):
    type: str
    text: str | None = None


class FunctionCallParam(_Request):
    name: str
    arguments: str | dict = "{}"     # JSON text (OpenAI's); vLLM also takes an object


class ToolCallParam(_Request):
    """An earlier assistant turn's call, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None     # an assistant turn's calls
    tool_call_id: str | None = None                   # a tool turn: the call it answers

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages[{index}] has a content part of type {part.type!r}; this server "
                                    f"takes text parts only", f"messages.{index}.content")
            parts.append(part.text)
        return "".join(parts)


class FunctionDef(_Request):
    name: Name
    description: str | None = None
    parameters: dict | None = None     # a JSON schema of its arguments (None: it takes none)
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Request):
    name: Name


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[Tool] | None = None
    # None: "auto" with tools, else "none" (OpenAI's and vLLM's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True             # false: only the first call is answered (vLLM's)
    include_reasoning: bool = True               # vLLM's: with a reasoning parser, false leaves the reasoning out
    # OpenAI's (and vLLM's "max"): a template variable; set, it also sets enable_thinking (false for "none") unless
    # chat_template_kwargs do
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False     # vLLM's: the last (assistant) message is continued, left open
    add_special_tokens: bool = False     # vLLM's: the templated text gets the tokenizer's special tokens too
    chat_template_kwargs: dict | None = None     # vLLM's: variables the chat template reads
    documents: list[dict] | None = None          # vLLM's: for templates that read documents
    chat_template: str | None = None             # vLLM's; refused (the checkpoint's template is used)
    echo: bool = False                           # vLLM's chat echo; refused

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.continue_final_message and self.add_generation_prompt:
            out.append(("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                                                  "true; set add_generation_prompt to false"))
        if self.top_logprobs and not self.logprobs:
            out.append(("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=true; set logprobs or "
                                        "leave top_logprobs out"))
        if self.chat_template is not None:
            out.append(("chat_template", "a chat template per request is not served (vLLM too refuses it by "
                                         "default); the checkpoint's template is used: leave chat_template out"))
        if self.echo:
            out.append(("echo", "echo on chat is not supported; leave it out (on /v1/completions echo returns the "
                                "prompt)"))
        out += [(k, f"OpenAI's deprecated {k} is not served; {how}") for k, how in DEPRECATED.items()
                if (self.model_extra or {}).get(k) is not None]
        return out + self._tool_problems()

    def _tool_problems(self) -> list[tuple[str, str]]:
        names = [t.function.name for t in self.tools or []]
        if self.tools == []:
            return [("tools", "tools is an empty list; pass at least one tool or leave tools out")]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            return [("tools", f"tools names the function {twice!r} twice; give each function one entry")]
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            return [("tool_choice", f"tool_choice={self.choice_name()!r} needs tools; pass the functions in tools")]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return [("tool_choice", f"tool_choice names the function {choice.function.name!r}, which is not in "
                                    f"tools ({', '.join(map(repr, names))}); name one of them")]
        return []

    def choice_name(self) -> str:
        """tool_choice as a word: "none", "auto", "required" or "named" (None resolved to its default)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def structured(self) -> tuple[dict | None, str | None]:
        """As _Sampling's, or the tool choice's constraint (`tool_constraint`); a 400 when both are given (vLLM's
        tool choice would override the other silently)."""
        spec, name = super().structured()
        forced = tool_constraint(self)
        if forced is None:
            return spec, name
        if spec is not None:
            raise APIError(400, f"tool_choice={self.choice_name()!r} constrains the output to tool calls, and {name} "
                                f"constrains it too; pass one of them", name)
        return forced, "tool_choice"

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def template_tools(self) -> list[dict] | None:
        """tools for the chat template (`template_tools`), whatever tool_choice says, as vLLM."""
        return template_tools(self.tools)


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """tools as the chat template reads them (None: none given)."""
    return None if not tools else [t.model_dump(exclude_none=True) for t in tools]


def tool_constraint(body: ChatCompletionRequest) -> dict | None:
    """The structured output a tool choice asks for (None: none). A named function: its parameters schema. "required":
    vLLM's schema, a JSON array of one or more {"name", "parameters"} objects (at most one with parallel_tool_calls
    false), each a tool's name and its parameters schema, with the tools' `$defs` merged at the top (a 400 when two
    tools define one name differently)."""
    choice = body.choice_name()
    tools = {t.function.name: t.function for t in body.tools or []}
    if choice == "named":
        return {"json": tools[body.tool_choice.function.name].parameters or empty_object()}
    if choice != "required":
        return None
    defs: dict = {}
    items = []
    for name, fn in tools.items():
        params = dict(fn.parameters or empty_object())
        own = params.pop("$defs", {})
        if not isinstance(own, dict):
            raise APIError(400, f"tools' function {name!r} has $defs that are not an object; give its parameters "
                                f"schema $defs as an object of named schemas", "tools")
        for key, schema in own.items():
            if defs.setdefault(key, schema) != schema:
                raise APIError(400, f"two tools define $defs.{key!r} differently; tool_choice='required' merges "
                                    f"their $defs, so give them one definition or different names", "tools")
        items.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1       # one call is all the answer keeps (vLLM's)
    return {"json": schema | ({"$defs": defs} if defs else {})}


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them (vLLM's): role, text content and name, an assistant turn's tool
    calls (their JSON arguments as objects) and a tool turn's tool_call_id."""
    out = []
    for i, m in enumerate(messages):
        d = {"role": m.role, "content": m.text(i)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls and m.role == "assistant":
            d["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, i, k)}}
                for k, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None and m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _arguments(arguments: str | dict, message: int, call: int) -> dict:
    """An earlier call's arguments as an object; text that is not a JSON object becomes {} with a warning, as vLLM
    does (a call cut short by max_tokens comes back so, and refusing it would refuse every later turn)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        logger.warning("messages[%d].tool_calls[%d].function.arguments is not a JSON object; the chat template gets "
                       "{} for it", message, call)
        return {}
    return value
