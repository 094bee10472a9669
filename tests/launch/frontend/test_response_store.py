"""ResponseStore (launch/frontend/response_store.py): what a stored response leaves for the next request, and the
bound. The expected conversations are written out by hand."""
from __future__ import annotations

import pytest

from launch.frontend.protocol import APIError
from launch.frontend.response_store import ResponseStore


def response(rid: str, *items) -> dict:
    return {"id": rid, "output": list(items)}


TEXT = {"type": "message", "content": [{"type": "output_text", "text": "Hi "}, {"type": "output_text", "text": "there"}]}
CALL = {"type": "function_call", "call_id": "c1", "name": "clock", "arguments": '{"zone": "utc"}'}
THOUGHT = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]}


def test_a_stored_response_leaves_its_input_then_its_text_and_calls_as_the_assistants_turn():
    store = ResponseStore(4)
    asked = [{"role": "user", "content": "Time?"}]
    store.put(response("r1", THOUGHT, TEXT, CALL), asked)
    assert store.conversation("r1") == asked + [{"role": "assistant", "content": "Hi there", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": '{"zone": "utc"}'}}]}]
    store.put(response("r2", THOUGHT), asked)          # reasoning alone makes no turn
    assert store.conversation("r2") == asked
    store.conversation("r2").append({"role": "user"})  # a copy: the stored one stays
    assert store.conversation("r2") == asked and store.response("r2") == response("r2", THOUGHT)


def test_a_call_sent_after_a_stored_turn_joins_it_and_leaves_the_stored_one_as_it_was():
    """A function_call item right after the stored assistant turn is a call of that turn (as when the whole
    conversation is sent as input), in a new message: the stored conversation stays as it was."""
    from launch.frontend.responses import ResponsesRequest
    store = ResponseStore(2)
    store.put(response("r1", {"type": "message", "content": [{"type": "output_text", "text": "Let me look."}]}),
              [{"role": "user", "content": "Time?"}])
    request = ResponsesRequest(previous_response_id="r1", input=[CALL, {"type": "function_call_output",
                                                                         "call_id": "c1", "output": "noon"}])
    turn = {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": '{"zone": "utc"}'}}]}
    assert request.messages(store.conversation("r1")) == [
        {"role": "user", "content": "Time?"}, turn, {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    assert store.conversation("r1")[-1] == {"role": "assistant", "content": "Let me look."}


def test_the_store_keeps_the_most_recently_used_and_none_at_zero():
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(response(rid, TEXT), [])
    store.response("a")                  # read: kept over b
    store.put(response("c", TEXT), [])
    with pytest.raises(APIError) as e:
        store.response("b")
    assert (e.value.status, e.value.param) == (404, "response_id") and "'b'" in e.value.message
    assert store.delete("a") == {"id": "a", "object": "response", "deleted": True}
    with pytest.raises(APIError) as e:
        store.conversation("a")
    assert (e.value.status, e.value.param) == (404, "previous_response_id")
    off = ResponseStore(0)
    off.put(response("x", TEXT), [])
    assert not off.enabled
    with pytest.raises(APIError, match="stores no responses"):
        off.response("x")
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="capacity"):
            ResponseStore(bad)
