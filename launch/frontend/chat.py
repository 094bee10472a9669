"""Chat completions' request shapes (POST /v1/chat/completions): messages, the chat template's options and the
chat-only sampling fields; the fields shared with completions are protocol.py's `_Sampling`."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .protocol import APIError, NumLogprobs, _Request, _Sampling


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
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
        if self.tools:
            out.append(("tools", "tool calling is not supported; leave tools out"))
        if self.tool_choice not in (None, "none"):
            out.append(("tool_choice", "tool calling is not supported; leave tool_choice out"))
        return out

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs

    def conversation(self) -> list[dict]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict]:
    return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(messages)]
