"""Stored responses of /v1/responses (launch/frontend/responses.py): OpenAI's `store` and `previous_response_id`.

A response created with `store` true (OpenAI's default) is kept, with the conversation it ends: its input as chat
messages (without its instructions, which OpenAI does not carry over), then its output as the assistant's turn
(its text and calls; reasoning is left out, as chat templates drop an earlier turn's). GET /v1/responses/{id}
answers it, DELETE /v1/responses/{id} forgets it, and a request whose `previous_response_id` names it continues
that conversation: its own instructions, the stored messages, then its input. The store is the front process's
memory, bounded: the `capacity` most recently stored or read responses (serve.py's --responses-store, 0: none
kept, `store` is answered false and every id is unknown, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE). So a
restarted server, or a response pushed out by newer ones, is unknown: a 404 naming the id.
"""
from __future__ import annotations

from collections import OrderedDict

from .protocol import APIError

DEFAULT_CAPACITY = 256


def assistant_turn(response: dict) -> dict | None:
    """A response's output as the assistant's chat message (None: it has neither text nor calls)."""
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part.get("type") == "output_text")
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in response["output"] if item["type"] == "function_call"]
    if not text and not calls:
        return None
    return {"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {})


class ResponseStore:
    """The last `capacity` stored responses by id, each with the conversation it ends (module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"responses store capacity={capacity!r} is invalid: pass an integer >= 0 (0: keep "
                             f"none)")
        self.capacity = capacity
        self._kept: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        """Keep a finished response; conversation: the messages it answered (without instructions)."""
        if not self.enabled:
            return
        turn = assistant_turn(response)
        self._kept[response["id"]] = (response, conversation + ([turn] if turn else []))
        self._kept.move_to_end(response["id"])
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def _entry(self, response_id: str, param: str) -> tuple[dict, list[dict]]:
        if response_id not in self._kept:
            why = "this server stores no responses (its store holds 0: serve.py's --responses-store)" if \
                not self.enabled else \
                "it was never stored here (store false), or it was deleted, or pushed out by newer ones"
            raise APIError(404, f"Response with id {response_id!r} not found: {why}", param)
        self._kept.move_to_end(response_id)
        return self._kept[response_id]

    def response(self, response_id: str) -> dict:
        """The stored response (404 naming the id when there is none)."""
        return self._entry(response_id, "response_id")[0]

    def conversation(self, response_id: str) -> list[dict]:
        """The messages a request continuing response_id starts with (404 naming the id when there is none)."""
        return list(self._entry(response_id, "previous_response_id")[1])

    def delete(self, response_id: str) -> dict:
        """Forget a stored response (404 naming the id when there is none); OpenAI's answer."""
        self._entry(response_id, "response_id")
        del self._kept[response_id]
        return {"id": response_id, "object": "response", "deleted": True}
