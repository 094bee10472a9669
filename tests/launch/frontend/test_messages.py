"""Anthropic's Messages API without a server (launch/frontend/messages.py): the chat conversation a request makes
and the stop reasons, written out by hand from vLLM 0.32's rules; bad requests are 400s naming the field."""
from __future__ import annotations

import pytest

from launch.frontend.messages import MessagesRequest, error_body, stop_reason
from launch.frontend.protocol import APIError


def test_blocks_make_vllms_chat_conversation():
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    request = MessagesRequest(max_tokens=4, system=system, messages=[
        {"role": "user", "content": "Time and weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "two calls", "signature": "s"},
                                          {"type": "tool_use", "id": "a", "name": "clock", "input": {"zone": "utc"}},
                                          {"type": "tool_use", "id": "b", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "text", "text": "Here:"},
                                     {"type": "tool_result", "tool_use_id": "a", "content": [
                                         {"type": "text", "text": "noon"}, {"type": "text", "text": "UTC"}]},
                                     {"type": "tool_result", "tool_use_id": "b", "content": None}]}])
    assert request.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time and weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "clock", "arguments": '{"zone": "utc"}'}},
            {"id": "b", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "noon\nUTC"},       # the results first (vLLM's order)
        {"role": "tool", "tool_call_id": "b", "content": ""},
        {"role": "user", "content": "Here:"}]
    chat = MessagesRequest(max_tokens=4, messages=[{"role": "user", "content": "hi"}], stop_sequences=["x"], top_k=3,
                           tools=[{"name": "clock", "input_schema": {"type": "object"}}],
                           tool_choice={"type": "any", "disable_parallel_tool_use": True},
                           thinking={"type": "disabled"}).chat()
    assert (chat.stop, chat.top_k, chat.tool_choice, chat.parallel_tool_calls, chat.reasoning_effort) == (
        ["x"], 3, "required", False, "none")


@pytest.mark.parametrize("finish,stop,arguments,want", [
    ("length", "x", ['{"a": 1}'], ("max_tokens", None)),
    ("stop", "x", ['{"a": 1}'], ("tool_use", None)),              # whole calls: they run
    ("stop", "x", ['{"a": 1}', '{"a"'], ("stop_sequence", "x")),   # a call the stop string cut must not run
    ("tool_calls", None, ['{"a"'], ("tool_use", None)),
    ("stop", 7, [], ("end_turn", None)),                          # a stop token id is no stop sequence
    ("stop", None, [], ("end_turn", None)),
])
def test_stop_reasons_are_vllms(finish, stop, arguments, want):
    assert stop_reason(finish, stop, arguments) == want


@pytest.mark.parametrize("fields,param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool"}},
     "tool_choice.name"),
])
def test_bad_requests_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        MessagesRequest(**fields).chat()
    assert (e.value.status, e.value.param) == (400, param) and param in e.value.message
    assert error_body(e.value) == {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": e.value.message}}
    assert error_body(APIError(503, "loading", kind="server_error"))["error"]["type"] == "overloaded_error"
