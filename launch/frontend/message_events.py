"""Anthropic's Messages API streamed (launch/frontend/messages.py has the request and the unstreamed answer): a
streamed chat completion's chunks become server-sent events "event: TYPE" + "data: JSON", in Anthropic's order:
message_start (the message with no content, its usage's input tokens), then per content block
content_block_start, its deltas (thinking_delta, text_delta, or a tool_use's input_json_delta: the call's
arguments as they come) and content_block_stop, then message_delta (stop_reason, stop_sequence, and the whole
usage: output tokens, and the input tokens less those found cached, which message_start cannot know yet) and
message_stop. A stream with no block sends one empty text block, as the unstreamed answer has. An error midway is
an "error" event. The interface is response_events.Events' (start, chunk, end), so its `translate` reads the chat
stream.
"""
from __future__ import annotations

import json

from .messages import shell, stop_reason, usage
from .response_events import delta_parts


class MessageEvents:
    """A streamed chat completion's chunks -> the Messages API's events (SSE text, in order)."""

    def __init__(self, model: str):
        self.message = shell(model)
        self.started = False
        self.index = -1                 # the open block's index (-1: none yet)
        self.kind: str | None = None    # the open block's type (None: none open)
        self.calls: list[list[str]] = []     # each call's argument pieces
        self.finish_reason: str | None = None
        self.stop: int | str | None = None
        self.usage: dict | None = None
        self.failed = False

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def start(self) -> list[str]:
        return []       # message_start waits for the first chunk, which carries the prompt's usage

    def _start(self, data: dict) -> list[str]:
        if self.started:
            return []
        self.started = True
        counted = usage(data.get("usage")) | {"output_tokens": 0}
        return [self._event("message_start", message=self.message | {"usage": counted})]

    def _open(self, block: dict) -> list[str]:
        out = self._close()
        self.index, self.kind = self.index + 1, block["type"]
        return out + [self._event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [self._event("content_block_stop", index=self.index)]

    def _delta(self, kind: str, block: dict, delta: dict) -> list[str]:
        """A delta of a block of `kind`, opening one when the open block is not."""
        out = [] if self.kind == kind else self._open(block)
        return out + [self._event("content_block_delta", index=self.index, delta=delta)]

    def _arguments(self, more: str) -> list[str]:
        """The input_json_delta event of an argument piece of the open tool_use block (none when none is open)."""
        if self.kind != "tool_use":
            return []
        self.calls[-1].append(more)
        return [self._event("content_block_delta", index=self.index,
                            delta={"type": "input_json_delta", "partial_json": more})]

    def chunk(self, data: dict) -> list[str]:
        """The events of one chat chunk (its data)."""
        if "error" in data:
            self.failed = True
            return self._start(data) + self._close() + [self._event("error", error={
                "type": "api_error", "message": data["error"].get("message", "")})]
        out = self._start(data)
        if data.get("usage") is not None:
            self.usage = data["usage"]
        for c in data.get("choices", []):
            for kind, value in delta_parts(c["delta"]):
                if kind == "call":
                    self.calls.append([])
                    out += self._open({"type": "tool_use", "id": value[0], "name": value[1], "input": {}})
                elif kind == "arguments":
                    out += self._arguments(value)
                elif kind == "reasoning":
                    out += self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                       {"type": "thinking_delta", "thinking": value})
                else:
                    out += self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": value})
            if c.get("finish_reason"):
                self.finish_reason, self.stop = c["finish_reason"], c.get("stop_reason")
        return out

    def end(self) -> list[str]:
        if self.failed:
            return []
        out = self._start({"usage": self.usage}) + (self._open({"type": "text", "text": ""}) if self.index < 0 else [])
        reason, sequence = stop_reason(self.finish_reason, self.stop, ["".join(c) for c in self.calls])
        return out + self._close() + [
            self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                        usage=usage(self.usage)),      # the whole request's (the cached tokens known now)
            self._event("message_stop")]
