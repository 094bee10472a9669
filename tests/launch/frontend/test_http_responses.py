"""The Responses API (POST /v1/responses, launch/frontend/responses.py) on an in-process server with the deepseek_r1
reasoning parser and hermes tools (test_http_reasoning.py's: a tiny checkpoint whose tokenizer has think tokens).

Oracles: transformers' greedy output for the chat template of the conversation the test writes out itself (split
at "</think>" by the test), and the chat completion of that conversation for the calls; the openai SDK's own types
must read every response and every streamed event, and the events must add up to the response."""
from __future__ import annotations

import http.client
import json

import pytest

from tests.launch.frontend.test_http_logprobs import post
from tests.launch.frontend.test_http_tools import biased
from tests.launch.frontend.test_http_reasoning import BIAS, MAX_NEW, MODEL, oracle, thinking_server

openai_types = pytest.importorskip("openai.types.responses")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with thinking_server(tmp_path_factory) as s:
        yield s


def respond(served, **fields) -> dict:
    code, data = post(served, "/v1/responses", {"model": MODEL, "temperature": 0, "max_output_tokens": MAX_NEW,
                                                "ignore_eos": True, "logit_bias": {str(served.end): BIAS}, **fields})
    assert code == 200, data
    openai_types.Response.model_validate(data)      # the SDK reads it
    return data


def events(served, **fields) -> list[dict]:
    """The streamed events' data, each read by the SDK's event types; the SSE event names match their types."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    body = {"model": MODEL, "temperature": 0, "max_output_tokens": MAX_NEW, "ignore_eos": True,
            "logit_bias": {str(served.end): BIAS}, "stream": True, **fields}
    conn.request("POST", "/v1/responses", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200, raw
    out = []
    for block in filter(None, raw.split("\n\n")):
        name, data = block.split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert name == "event: " + out[-1]["type"]
    from pydantic import TypeAdapter
    adapter = TypeAdapter(openai_types.ResponseStreamEvent)
    for e in out:
        adapter.validate_python(e)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def items(reasoning: str, content: str) -> list[tuple]:
    """What texts() says of a response with this reasoning and content (an empty one makes no item)."""
    return [(kind, text) for kind, text in (("reasoning", reasoning), ("message", content)) if text]


def texts(response: dict) -> list[tuple]:
    """(type, text or (name, arguments)) of each output item."""
    out = []
    for item in response["output"]:
        if item["type"] == "function_call":
            out.append(("function_call", (item["name"], item["arguments"])))
        else:
            out.append((item["type"], "".join(p["text"] for p in item["content"])))
    return out


def test_a_response_is_the_reasoning_then_the_text_of_the_greedy_output(served):
    out, text = oracle(served, BIAS)
    reasoning, content = text.split("</think>", 1)
    got = respond(served, input="Hello experts")
    assert texts(got) == items(reasoning, content) and reasoning and content
    assert (got["status"], got["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [i["status"] for i in got["output"]] == ["completed", "incomplete"]      # the item cut, as OpenAI's
    assert got["usage"]["output_tokens"] == MAX_NEW and got["usage"]["output_tokens_details"] == {
        "reasoning_tokens": out.index(served.end)}
    assert got["usage"]["input_tokens"] + MAX_NEW == got["usage"]["total_tokens"]
    # the same conversation as items, streamed: the events add up to the response they end with
    evs = events(served, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello experts"}]}])
    kinds = [e["type"] for e in evs]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    final = evs[-1]["response"]
    assert texts(final) == texts(got)
    # the second time, the prompt's whole blocks of 16 before its last token were cached (always reported, as vLLM)
    again, first = dict(final["usage"]), dict(got["usage"])
    assert again.pop("input_tokens_details")["cached_tokens"] == (first["input_tokens"] - 1) // 16 * 16 > 0
    first.pop("input_tokens_details")
    assert again == first
    assert "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta") == reasoning
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == content
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert done == final["output"] and [e["output_index"] for e in evs if e["type"] == "response.output_item.added"
                                        ] == [0, 1]


# a conversation with an earlier call and its result, as the chat template reads it (the oracle's; the Messages
# API's test sends it too)
EARLIER_TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]
EARLIER_CALL = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": {"zone": "utc"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]


def test_instructions_and_earlier_calls_make_the_chat_conversation(served):
    """instructions, an earlier answer, its function call and the call's output: the greedy output is transformers'
    on the chat template of the conversation the test writes out (a system turn, one assistant turn with its text
    and its call, as a response's output sent back makes it, and a tool turn)."""
    tools, messages = EARLIER_TOOLS, EARLIER_CALL
    out, text = oracle(served, BIAS, tools, messages=messages)
    reasoning, content = text.split("</think>", 1)
    got = respond(served, instructions="Be brief.", tools=[{"type": "function", "name": "clock", "parameters": {
        "type": "object"}}], input=[{"role": "user", "content": "Time?"},
                                    {"type": "message", "role": "assistant", "content": [
                                        {"type": "output_text", "text": "Let me look."}]},
                                    {"type": "function_call", "call_id": "call_1", "name": "clock",
                                     "arguments": '{"zone": "utc"}'},
                                    {"type": "function_call_output", "call_id": "call_1",
                                     "output": [{"type": "input_text", "text": "noon"}]}])
    assert texts(got) == items(reasoning, content)


def json_bias(served) -> dict[str, float]:
    """"</think>" pushed up (the grammar binds after it) and whitespace down (the random model would fill JSON with
    it until max tokens)."""
    return {str(t): v for t, v in biased(served.tokenizer).items()} | {str(served.end): 8.0}


def test_calls_are_function_call_items(served):
    """A named function: the chat completion's call (already checked against transformers elsewhere) is the
    response's function_call item, unstreamed and streamed, with the call's id as call_id."""
    tool = {"type": "function", "name": "clock", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}
    code, chat = post(served, "/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "max_tokens": 64, "logit_bias": json_bias(served),
        "messages": [{"role": "user", "content": "Time?"}], "tools": [{"type": "function", "function": {
            k: v for k, v in tool.items() if k != "type"}}], "tool_choice": {"type": "function", "function": {
                "name": "clock"}}})
    assert code == 200, chat
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in chat["choices"][0]["message"]["tool_calls"]]
    fields = dict(input="Time?", tools=[tool], tool_choice={"type": "function", "name": "clock"}, max_output_tokens=64,
                  logit_bias=json_bias(served), ignore_eos=False)
    got = respond(served, **fields)
    assert [x for t, x in texts(got) if t == "function_call"] == want and got["status"] == "completed"
    assert all(i["call_id"].startswith("chatcmpl-tool-") for i in got["output"] if i["type"] == "function_call")
    evs = events(served, **fields)
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    assert [x for t, x in texts(evs[-1]["response"]) if t == "function_call"] == want == [("clock", args)]
    # the call's output, sent with previous_response_id, continues the conversation as the whole of it sent as
    # input does (the stored call and its output in one assistant turn, then a tool turn; the calls' text is
    # the test's own from the response): with no call text before it, and with some
    call = next(i for i in got["output"] if i["type"] == "function_call")
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "noon"}
    more = dict(max_output_tokens=8)      # no tools: the template fits in max_model_len
    whole = respond(served, input=[{"role": "user", "content": "Time?"}, {
        "type": "function_call", "call_id": call["call_id"], "name": "clock", "arguments": call["arguments"]},
        result], **more)
    continued = respond(served, previous_response_id=got["id"], input=[result], **more)
    assert texts(continued) == texts(whole)
    code, err = post(served, "/v1/responses", {"model": MODEL, "previous_response_id": got["id"], "input": [
        {k: call[k] for k in ("type", "call_id", "name", "arguments")}, result], **more})
    assert code == 400 and err["error"]["param"] == "input" and call["call_id"] in err["error"]["message"], err


@pytest.mark.parametrize("fields,param", [
    ({"background": True}, "background"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": []}, "input"),
])
def test_what_is_not_served_is_a_400_naming_the_responses_field(served, fields, param):
    code, data = post(served, "/v1/responses", {"model": MODEL, "input": "hi", **fields})
    assert code == 400 and data["error"]["param"] == param, data


def test_a_json_schema_format_constrains_the_text(served):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    got = respond(served, input="hi", max_output_tokens=64, ignore_eos=False, logit_bias=json_bias(served),
                  text={"format": {"type": "json_schema", "schema": schema, "strict": True}})
    message = [x for t, x in texts(got) if t == "message"]
    assert got["status"] == "completed" and json.loads(message[0])["a"] in ("x", "y")
    # echoed with the name it ran under (the SDK's type needs one)
    assert got["text"] == {"format": {"type": "json_schema", "name": "output", "schema": schema, "strict": True}}


@pytest.mark.parametrize("chat,responses", [
    ("max_tokens", "max_output_tokens"), ("messages.3.content", "input"), ("response_format.json_schema",
                                                                             "text.format"),
    ("tools.0.function.parameters", "tools.0.parameters"), ("reasoning_effort", "reasoning.effort"),
    ("temperature", "temperature"), (None, None)])
def test_a_chat_fields_400_names_the_responses_field(chat, responses):
    from launch.frontend.responses import field_of
    assert field_of(chat) == responses


def test_streamed_calls_make_the_function_call_items_of_the_unstreamed_response():
    """Chat streams of glm45 calls (argument pieces as they come, the last call's rest in the final chunk beside
    content that came between the calls) make, through the Responses events, the items of the unstreamed
    response: each call's arguments whole and in its own item, for every split of the text."""
    from launch.frontend.response_events import Events
    from launch.frontend.responses import ResponsesRequest, answer
    from launch.frontend.tool_parsers import PARSERS
    from launch.frontend.tools import ToolPlan
    from tests.launch.frontend.test_http_tools import GLM_TOOLS, splits, stream_chunks

    text = ('Checking both.\n<tool_call>clock</tool_call>\n<tool_call>weather<arg_key>city</arg_key><arg_value>Rome'
            '</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>')
    plan, request = ToolPlan("auto", parser=PARSERS["glm45"], schemas=GLM_TOOLS), ResponsesRequest(input="hi")
    message, finish = plan.message(text, "stop")
    want = [(i["type"], i.get("name"), i.get("arguments") or i.get("content", [{}])[0].get("text"))
            for i in answer(request, MODEL, {"choices": [{"message": message, "finish_reason": finish}]})["output"]]
    assert [w[0] for w in want] == ["message", "function_call", "function_call"], want
    for pieces in splits(text):
        events = Events(request, MODEL)
        for chunk in stream_chunks(plan, pieces):
            events.chunk(chunk)
        done = json.loads(events.end()[-1].split("data: ", 1)[1])["response"]
        got = [(i["type"], i.get("name"), i.get("arguments") or i["content"][0]["text"]) for i in done["output"]]
        calls = [g for g in got if g[0] == "function_call"]
        assert calls == [w for w in want if w[0] == "function_call"], (pieces, got)
        assert "".join(g[2] for g in got if g[0] == "message") == want[0][2], (pieces, got)


def fetch(served, method: str, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    conn.request(method, path)
    resp = conn.getresponse()
    data = json.loads(resp.read().decode())
    conn.close()
    return resp.status, data


def test_a_stored_response_is_read_back_and_continued_by_previous_response_id(served):
    """store (OpenAI's default) keeps a response: GET answers it, and previous_response_id continues its
    conversation: the greedy output is transformers' on the chat template of the conversation the test writes out
    (the new instructions, the earlier input, the earlier answer's text as the assistant's turn without its
    reasoning, the new input), unstreamed and streamed. store false keeps none; DELETE forgets one; an unknown id is
    a 404 naming the field."""
    first = respond(served, instructions="Be brief.", input="Hello experts")
    assert first["store"] is True and first["previous_response_id"] is None
    code, got = fetch(served, "GET", f"/v1/responses/{first['id']}")
    assert code == 200 and got == first
    openai_types.Response.model_validate(got)
    earlier = dict(texts(first))["message"]
    messages = [{"role": "system", "content": "Again."}, {"role": "user", "content": "Hello experts"},
                {"role": "assistant", "content": earlier}, {"role": "user", "content": "More"}]
    reasoning, _, content = oracle(served, BIAS, messages=messages)[1].partition("</think>")
    second = respond(served, instructions="Again.", previous_response_id=first["id"], input="More")
    assert texts(second) == items(reasoning, content) and second["previous_response_id"] == first["id"], (
        texts(second), reasoning, content)
    evs = events(served, instructions="Again.", previous_response_id=first["id"], input="More", store=False)
    final = evs[-1]["response"]
    assert texts(final) == texts(second) and final["store"] is False
    assert fetch(served, "GET", f"/v1/responses/{final['id']}")[0] == 404      # store false: not kept
    # a streamed one is kept too, and continues as the unstreamed one
    streamed_first = events(served, instructions="Be brief.", input="Hello experts")[-1]["response"]
    assert fetch(served, "GET", f"/v1/responses/{streamed_first['id']}") == (200, streamed_first)
    again = respond(served, instructions="Again.", previous_response_id=streamed_first["id"], input="More")
    assert texts(again) == texts(second)
    assert fetch(served, "DELETE", f"/v1/responses/{first['id']}") == (200, {"id": first["id"], "object": "response",
                                                                            "deleted": True})
    code, err = fetch(served, "GET", f"/v1/responses/{first['id']}")
    assert code == 404 and first["id"] in err["error"]["message"] and err["error"]["param"] == "response_id"
    code, err = post(served, "/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": first["id"]})
    assert code == 404 and err["error"]["param"] == "previous_response_id", err
