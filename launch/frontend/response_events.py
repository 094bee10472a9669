"""The Responses API's streamed events (launch/frontend/responses.py has the request and the unstreamed answer): a
streamed chat completion's chunks become server-sent events "event: TYPE" + "data: JSON", each with its
sequence_number, in OpenAI's order: response.created, response.in_progress; per output item output_item.added,
content_part.added, the deltas (reasoning_text, output_text, function_call_arguments), their done events,
content_part.done, output_item.done; then response.completed (or response.incomplete), which carries the whole
response; an error midway is an "error" event, then response.failed.
"""
from __future__ import annotations

import json

from .responses import ResponsesRequest, call_item, finish, message_item, reasoning_item


def delta_parts(delta: dict):
    """A chat delta's parts in the order a converted stream (Responses, Messages) shows them: the open call's
    argument pieces first (a final chunk carries them beside content that follows the calls), then reasoning,
    content, and each call with an id (it opens one) or its argument piece. Yields (kind, value): ("arguments",
    text), ("reasoning", text), ("content", text) or ("call", (id, name))."""
    calls = delta.get("tool_calls") or []
    opens = next((k for k, call in enumerate(calls) if "id" in call), len(calls))
    for k, call in enumerate(calls):
        if k == opens:
            yield from ((kind, delta[kind]) for kind in ("reasoning", "content") if delta.get(kind))
        if "id" in call:
            yield "call", (call["id"], call["function"].get("name", ""))
        if more := call.get("function", {}).get("arguments"):
            yield "arguments", more
    if opens == len(calls):
        yield from ((kind, delta[kind]) for kind in ("reasoning", "content") if delta.get(kind))


class Events:
    """A streamed chat completion's chunks -> the Responses API's events (SSE text, in order). done: called with
    the final response unless it failed (the route stores it)."""

    def __init__(self, request: ResponsesRequest, model: str, done=lambda response: None):
        self.response, self.done = request.shell(model), done
        self.seq = 0
        self.item: dict | None = None     # the output item being streamed
        self.pieces: list[str] = []       # its text, or its arguments, so far (joined once, when it closes)
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.error: dict | None = None     # the chat stream's error, which fails the response

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    @property
    def _at(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.response["output"])}

    def _open(self, item: dict) -> list[str]:
        out = self._close()
        self.item, self.pieces = item, []
        shown = item | {"status": "in_progress"}
        if item["type"] == "message":
            shown["content"] = []
        elif item["type"] == "reasoning":
            shown.pop("content")
        out.append(self._event("response.output_item.added", output_index=len(self.response["output"]), item=shown))
        if item["type"] != "function_call":
            part = item["content"][0] | {"text": ""}
            out.append(self._event("response.content_part.added", **self._at, content_index=0, part=part))
        return out

    def _delta(self, kind: str, text: str) -> list[str]:
        """Events for text of an item of `kind` ("reasoning", "message"), opening one when the open item is not."""
        out = [] if self.item is not None and self.item["type"] == kind else self._open(
            reasoning_item("") if kind == "reasoning" else message_item(""))
        self.pieces.append(text)
        name, extra = ("response.reasoning_text.delta", {}) if kind == "reasoning" else (
            "response.output_text.delta", {"logprobs": []})
        return out + [self._event(name, **self._at, content_index=0, delta=text, **extra)]

    def _close(self, status: str = "completed") -> list[str]:
        if self.item is None:
            return []
        text = "".join(self.pieces)
        item, at, out = self.item, self._at, []
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = text
            out.append(self._event("response.function_call_arguments.done", **at, name=item["name"],
                                   arguments=text))
        else:
            part = item["content"][0] | {"text": text}
            item["content"] = [part]
            if item["type"] == "message":
                out.append(self._event("response.output_text.done", **at, content_index=0, text=text,
                                       logprobs=[]))
            else:
                out.append(self._event("response.reasoning_text.done", **at, content_index=0, text=text))
            out.append(self._event("response.content_part.done", **at, content_index=0, part=part))
        out.append(self._event("response.output_item.done", output_index=at["output_index"], item=item))
        self.response["output"].append(item)
        self.item = None
        return out

    def chunk(self, data: dict) -> list[str]:
        """The events of one chat chunk (its data)."""
        if "error" in data:
            self.error = e = data["error"]
            return self._close() + [self._event("error", code=e.get("code"), message=e.get("message"),
                                                param=e.get("param"))]
        if data.get("usage") is not None:
            self.usage = data["usage"]
        out = []
        for c in data.get("choices", []):
            for kind, value in delta_parts(c["delta"]):
                if kind == "call":
                    out += self._open(call_item(*value, ""))
                elif kind == "arguments":
                    out += self._arguments(value)
                else:
                    out += self._delta("message" if kind == "content" else kind, value)
            self.finish_reason = c.get("finish_reason") or self.finish_reason
        return out

    def _arguments(self, more: str) -> list[str]:
        """The event of an argument piece of the open function_call item (none when the open item is not one)."""
        if self.item is None or self.item["type"] != "function_call":
            return []
        self.pieces.append(more)
        return [self._event("response.function_call_arguments.delta", **self._at, delta=more)]

    def end(self) -> list[str]:
        out = self._close("incomplete" if self.finish_reason == "length" else "completed")
        if self.error is not None:
            failed = self.response | {"status": "failed", "error": {"code": "server_error",
                                                                   "message": self.error.get("message", "")}}
            return out + [self._event("response.failed", response=failed)]
        final = finish(self.response, self.finish_reason, self.usage)
        self.done(final)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=final)]


async def translate(chat_events, events: Events):
    """A streamed chat completion's SSE text -> the Responses API's."""
    for e in events.start():
        yield e
    async for text in chat_events:
        for line in (text if isinstance(text, str) else text.decode()).split("\n"):
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                for e in events.end():
                    yield e
                return
            for e in events.chunk(json.loads(line[len("data: "):])):
                yield e
