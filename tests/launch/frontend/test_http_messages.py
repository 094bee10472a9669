"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens; launch/frontend/messages.py and
message_events.py) on an in-process server with the deepseek_r1 reasoning parser and hermes tools
(test_http_reasoning.py's: a tiny checkpoint whose tokenizer has think tokens).

Oracles: transformers' greedy output for the chat template of the conversation the test writes out itself (split
at "</think>" by the test), the chat completion of that conversation for a call, and the template's own token count;
the anthropic SDK (its types read every message and event, its stream helper assembles the events into the
message it ends with)."""
from __future__ import annotations

import json

import pytest

from tests.launch.frontend.test_http_logprobs import post
from tests.launch.frontend.test_http_reasoning import BIAS, MAX_NEW, MODEL, oracle, thinking_server
from tests.launch.frontend.test_http_responses import EARLIER_CALL, EARLIER_TOOLS, json_bias

anthropic = pytest.importorskip("anthropic")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with thinking_server(tmp_path_factory) as s:
        yield s


@pytest.fixture
def client(served):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{served.port}", api_key="unused", max_retries=0,
                               timeout=120)


def extra(served, bias: float = BIAS) -> dict:
    """Greedy (temperature goes in the body: this SDK has no such argument) and the oracle's bias."""
    return {"temperature": 0, "ignore_eos": True, "logit_bias": {str(served.end): bias}}


def blocks(message) -> list[tuple]:
    """(type, its text or (name, input)) of each content block (an SDK Message or its dict)."""
    data = message if isinstance(message, dict) else message.model_dump()
    out = []
    for b in data["content"]:
        if b["type"] == "tool_use":
            out.append(("tool_use", (b["name"], b["input"])))
        else:
            out.append((b["type"], b.get("thinking", b.get("text"))))
    return out


def want(reasoning: str, content: str) -> list[tuple]:
    """What blocks() says of a message with this reasoning and content (an empty one makes no block)."""
    return [(kind, text) for kind, text in (("thinking", reasoning), ("text", content)) if text]


def test_a_message_is_the_thinking_then_the_text_of_the_greedy_output(served, client):
    out, text = oracle(served, BIAS)
    reasoning, content = text.split("</think>", 1)
    assert reasoning and content
    got = client.messages.create(model=MODEL, max_tokens=MAX_NEW, extra_body=extra(served),
                                 messages=[{"role": "user", "content": "Hello experts"}])
    assert blocks(got) == [("thinking", reasoning), ("text", content)]
    assert (got.stop_reason, got.stop_sequence, got.usage.output_tokens) == ("max_tokens", None, MAX_NEW)
    assert got.id.startswith("msg_") and got.role == "assistant" and got.model == MODEL
    # streamed, as blocks of text parts: the SDK assembles the events into the same message
    with client.messages.stream(model=MODEL, max_tokens=MAX_NEW, extra_body=extra(served),
                                messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                                       {"type": "text", "text": "experts"}]}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert blocks(final) == blocks(got) and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == MAX_NEW and final.usage.input_tokens == got.usage.input_tokens > 0
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds


def test_system_and_an_earlier_call_make_the_chat_conversation(served, client):
    """system, an assistant turn with text and a tool_use, and the user's tool_result: the greedy output is
    transformers' on the chat template of the conversation the test writes out, and count_tokens counts it."""
    tools, messages = EARLIER_TOOLS, EARLIER_CALL
    ids, text = oracle(served, BIAS, tools, messages=messages)
    reasoning, content = text.split("</think>", 1)
    request = dict(model=MODEL, max_tokens=MAX_NEW, system=[{"type": "text", "text": "Be brief."}],
                   tools=[{"name": "clock", "input_schema": {"type": "object"}}],
                   messages=[{"role": "user", "content": "Time?"},
                             {"role": "assistant", "content": [
                                 {"type": "thinking", "thinking": "hm", "signature": "x"},
                                 {"type": "text", "text": "Let me look."},
                                 {"type": "tool_use", "id": "call_1", "name": "clock", "input": {"zone": "utc"}}]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                                           "content": [{"type": "text", "text": "noon"}]}]}])
    got = client.messages.create(extra_body=extra(served), **request)
    assert blocks(got) == want(reasoning, content)
    tok = served.tokenizer
    count = len(tok.encode(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False))
    assert client.messages.count_tokens(**{k: v for k, v in request.items() if k != "max_tokens"}).input_tokens \
        == count == got.usage.input_tokens


def test_a_named_tool_is_a_tool_use_block(served, client):
    """tool_choice {"type": "tool"}: the chat completion's call (checked against transformers elsewhere) is the
    tool_use block, its arguments the block's input, unstreamed and streamed (input_json_delta pieces)."""
    schema = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
    bias = json_bias(served)
    code, chat = post(served, "/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "max_tokens": 64, "logit_bias": bias,
        "messages": [{"role": "user", "content": "Time?"}],
        "tools": [{"type": "function", "function": {"name": "clock", "parameters": schema}}],
        "tool_choice": {"type": "function", "function": {"name": "clock"}}})
    assert code == 200, chat
    call = chat["choices"][0]["message"]["tool_calls"][0]["function"]
    request = dict(model=MODEL, max_tokens=64, tools=[{"name": "clock", "input_schema": schema}],
                   tool_choice={"type": "tool", "name": "clock"}, messages=[{"role": "user", "content": "Time?"}],
                   extra_body={"temperature": 0, "logit_bias": bias})
    got = client.messages.create(**request)
    assert blocks(got)[-1] == ("tool_use", ("clock", json.loads(call["arguments"]))) and got.stop_reason == "tool_use"
    with client.messages.stream(**request) as s:
        pieces = [e.delta.partial_json for e in s if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        final = s.get_final_message()
    assert "".join(pieces) == call["arguments"] and len(pieces) > 1
    assert blocks(final) == blocks(got) and final.content[-1].id.startswith("chatcmpl-tool-")


def test_a_stop_sequence_is_named_and_errors_are_anthropics(served, client):
    _, text = oracle(served, BIAS)
    got = client.messages.create(model=MODEL, max_tokens=MAX_NEW, stop_sequences=["zzz", "</think>"],
                                 extra_body=extra(served), messages=[{"role": "user", "content": "Hello experts"}])
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", "</think>")     # the greedy answer writes it
    assert blocks(got) == [("thinking", text.split("</think>", 1)[0])]          # cut there: all reasoning
    for body, param in (({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
                        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
                         "messages.0.content.0"),
                        ({"max_tokens": 4, "tool_choice": {"type": "tool"}, "messages": [
                            {"role": "user", "content": "hi"}]}, "tool_choice.name"),
                        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
                        ({"max_tokens": 4, "tool_choice": {"type": "bogus"}, "messages": [
                            {"role": "user", "content": "hi"}]}, "tool_choice"),          # fails the body's schema
                        ({"count": True, "messages": [{"role": "user", "content": []}]}, "messages")):  # no message
        path = "/v1/messages/count_tokens" if body.pop("count", False) else "/v1/messages"
        code, err = post(served, path, {"model": MODEL, **body})
        assert code == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert param in err["error"]["message"], err
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
