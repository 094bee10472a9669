"""Tool calling on /v1/chat/completions (launch/frontend/chat.py, tools.py), on an in-process server (the app on
uvicorn in a thread, attached to one `LLM` on 1+1 spawned ranks) with auto tool choice through the hermes parser.

Oracles: transformers' greedy generate on the tiny tokenizer's own chat template rendered with the test's tools
(so the tools must reach the template), masked by an xgrammar matcher of the test's own, compiled from what the
test writes: a function's parameters schema (named), vLLM's documented array schema ("required"), or a regex
of Hermes-style text ("auto", which the request asks for as its structured output). The expected calls are
read from that text by the test's own parse. Streamed answers must say what the unstreamed ones say.

The random tiny model, let free, fills JSON with whitespace (allowed between its tokens) until max_tokens; the
requests push whitespace tokens down with logit_bias (and "," for "required", whose array would otherwise
repeat its first call), as the oracle does, so the JSON ends."""
from __future__ import annotations

import json
import re

import pytest

from launch import LLM
from launch.frontend.tool_parsers import PARSERS, hermes_calls
from launch.frontend.tools import ToolPlan
from tests.conftest import hf_greedy, hf_model
from tests.launch.frontend.test_app_before_attach import call
from tests.launch.frontend.in_process import serving
from tests.launch.frontend.test_http_logprobs import post
from tests.launch.test_structured_outputs import _hf_constrained

xgr = pytest.importorskip("xgrammar")

MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}, "days": {"enum": [1, 2]}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": TIME}}]
MESSAGES = [{"role": "user", "content": "Hello experts"}]
# vLLM's documented schema for tool_choice "required", written out here
REQUIRED = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
    {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": t["function"][
        "parameters"]}, "required": ["name", "parameters"]} for t in TOOLS]}}
HERMES = r'Sure<tool_call>\{"name": "(weather|clock)", "arguments": \{"city": "(paris|rome)"\}\}</tool_call>'
TWO_CALLS = r'<tool_call>\{"name": "clock", "arguments": \{"zone": "utc"\}\}</tool_call>' * 2
MAX_NEW = 96


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", max_position_embeddings=1024)      # room for the tools' JSON
    with LLM(path, attention_ranks=1, expert_ranks=1, max_model_len=1024, max_num_seqs=4) as llm, \
            serving(llm, path, MODEL, tool_parser="hermes") as (port, _):
        class Served:
            tokenizer = llm.tokenizer
            hf = hf_model(path)
            checkpoint = path
        Served.port, Served.llm = port, llm
        yield Served


def prompt_ids(tok, messages, tools=TOOLS) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def biased(tok, also: str = "") -> dict[int, float]:
    """A logit_bias of -100 for every token that is whitespace alone, and those of `also`."""
    return {t: -100.0 for t in range(len(tok)) if tok.decode([t]) and not tok.decode([t]).strip(" \t\r\n" + also)}


def oracle(served, compile_fn, bias: dict[int, float], max_new: int = MAX_NEW) -> tuple[str, str, list[int], int]:
    """(text, finish_reason, prompt ids, its tokens but EOS) of transformers' greedy output under the test's own
    grammar and bias."""
    tok = served.tokenizer
    ids = prompt_ids(tok, MESSAGES)
    out = _hf_constrained(served.hf, tok, ids, compile_fn, max_new, bias)
    finish = "stop" if out and out[-1] == tok.eos_token_id else "length"
    kept = out[:-1] if finish == "stop" else out
    return tok.decode(kept, skip_special_tokens=False), finish, ids, len(kept)


def chat(served, **fields) -> dict | list[dict]:
    code, data = post(served, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                                        "temperature": 0, "max_tokens": MAX_NEW, **fields})
    assert code == 200, data
    return data


def streamed(chunks: list[dict]) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) that a client assembles from one choice's chunks, as the openai
    client does: a call's name and arguments pieces joined under its index."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        for c in ch["choices"]:
            delta = c["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls", []):
                slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.get("id", slot["id"])
                slot["name"] += tc.get("function", {}).get("name", "")
                slot["arguments"] += tc.get("function", {}).get("arguments", "")
            finish = c["finish_reason"] or finish
    return content, [calls[k] for k in sorted(calls)], finish


def stream_chunks(answer, pieces: list[str]) -> list[dict]:
    """The chunks of one choice that answer's stream makes of these pieces of text (the last one final), ending
    with its finish_reason for an engine "stop"."""
    s = answer.stream()
    chunks = [{"choices": [{"delta": s.add(p, final=i == len(pieces) - 1), "finish_reason": None}]}
              for i, p in enumerate(pieces)]
    chunks[-1]["choices"][0]["finish_reason"] = s.finish_reason("stop")
    return chunks


def calls_of(message: dict) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]


def as_field(bias: dict[int, float]) -> dict:
    return {"logit_bias": {str(t): v for t, v in bias.items()}}


def test_a_named_function_answers_the_greedy_arguments_under_its_schema(served):
    bias = biased(served.tokenizer)
    text, finish, ids, _ = oracle(served, lambda c: c.compile_json_schema(json.dumps(WEATHER)), bias)
    assert json.loads(text)["city"] in ("paris", "rome")     # the grammar finished an object
    choice = {"type": "function", "function": {"name": "weather"}}
    got = chat(served, tool_choice=choice, return_token_ids=True, **as_field(bias))
    assert got["prompt_token_ids"] == ids           # the tools reached the template
    c = got["choices"][0]
    assert c["message"]["content"] == "" and calls_of(c["message"]) == [{"name": "weather", "arguments": text}]
    assert c["message"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-") and c["finish_reason"] == finish == "stop"
    content, calls, finish_s = streamed(chat(served, tool_choice=choice, stream=True, **as_field(bias)))
    assert (content, finish_s) == ("", "stop")
    assert len(calls) == 1 and calls[0]["name"] == "weather" and calls[0]["arguments"] == text and calls[0]["id"]
    # n = 2 (greedy: the same call twice), streamed with logprobs: each choice its own call, id and logprobs
    chunks = chat(served, tool_choice=choice, stream=True, n=2, logprobs=True, **as_field(bias))
    for i in range(2):
        mine = [{"choices": [c for c in ch["choices"] if c["index"] == i]} for ch in chunks]
        content, calls, finish_s = streamed(mine)
        assert (content, [(c["name"], c["arguments"]) for c in calls], finish_s) == ("", [("weather", text)], "stop")
        tokens = [t["token"] for ch in mine for c in ch["choices"] for t in (c["logprobs"] or {}).get("content", [])]
        assert "".join(tokens).startswith(text), (tokens, text)
    ids = {ch["choices"][0]["delta"]["tool_calls"][0].get("id") for ch in chunks
           if ch["choices"] and ch["choices"][0]["delta"].get("tool_calls")} - {None}
    assert len(ids) == 2


def test_required_answers_each_call_of_the_greedy_array(served):
    bias = biased(served.tokenizer, also=",")
    grammar = lambda c: c.compile_json_schema(json.dumps(REQUIRED))  # noqa: E731
    text, finish, _, num = oracle(served, grammar, bias)
    want = [{"name": i["name"], "arguments": json.dumps(i["parameters"])} for i in json.loads(text)]
    assert want and all(w["name"] in ("weather", "clock") for w in want)
    got = chat(served, tool_choice="required", **as_field(bias))["choices"][0]
    assert (got["message"]["content"], got["finish_reason"], finish) == ("", "tool_calls", "stop")
    assert calls_of(got["message"]) == want
    content, calls, finish_s = streamed(chat(served, tool_choice="required", stream=True, **as_field(bias)))
    assert (content, finish_s) == ("", "tool_calls")
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == want
    # cut short by max_tokens: no calls, content "", finish_reason "length" (vLLM's); streamed the same
    got = chat(served, tool_choice="required", max_tokens=6, **as_field(bias))["choices"][0]
    assert got["message"] == {"role": "assistant", "content": ""} and got["finish_reason"] == "length"
    assert streamed(chat(served, tool_choice="required", max_tokens=6, stream=True, **as_field(bias))) == (
        "", [], "length")
    # the array whole but EOS not drawn yet: the calls, with finish_reason "length" (vLLM's)
    got = chat(served, tool_choice="required", max_tokens=num, **as_field(bias))["choices"][0]
    assert calls_of(got["message"]) == want and got["finish_reason"] == "length"


def test_required_with_parallel_tool_calls_false_is_constrained_to_one_call(served):
    """Without "," pushed down the greedy array repeats its call until max_tokens; parallel_tool_calls false caps
    it at one item in the grammar (vLLM's maxItems), so the output ends after the first call."""
    bias = biased(served.tokenizer)
    text, finish, *_ = oracle(served, lambda c: c.compile_json_schema(json.dumps({**REQUIRED, "maxItems": 1})), bias)
    items = json.loads(text)
    assert len(items) == 1 and finish == "stop"
    want = [{"name": items[0]["name"], "arguments": json.dumps(items[0]["parameters"])}]
    for stream in (False, True):
        got = chat(served, tool_choice="required", parallel_tool_calls=False, stream=stream, **as_field(bias))
        if stream:
            content, calls, finish_s = streamed(got)
            assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == want
        else:
            c = got["choices"][0]
            assert calls_of(c["message"]) == want
            finish_s = c["finish_reason"]
        assert finish_s == "tool_calls"


def test_auto_finds_hermes_calls_in_the_text(served):
    text, finish, *_ = oracle(served, lambda c: c.compile_regex(HERMES), {})
    m = re.fullmatch(r"Sure<tool_call>(.*)</tool_call>", text)      # the test's own parse of Hermes' form
    assert m, (text, finish)
    body = json.loads(m.group(1))
    want = [{"name": body["name"], "arguments": json.dumps(body["arguments"])}]
    forced = {"structured_outputs": {"regex": HERMES}}
    got = chat(served, **forced)["choices"][0]             # tool_choice left out: auto, as tools are given
    assert got["message"]["content"] == "Sure" and calls_of(got["message"]) == want
    assert (got["finish_reason"], finish) == ("tool_calls", "stop")
    chunks = chat(served, stream=True, **forced)
    assert streamed(chunks)[::2] == ("Sure", "tool_calls")
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in streamed(chunks)[1]] == want
    pieces = [tc["function"]["arguments"] for ch in chunks for c in ch["choices"]
              for tc in c["delta"].get("tool_calls", []) if tc["function"].get("arguments")]
    assert len(pieces) > 2, pieces          # the arguments go out as the model writes them, not whole at the end
    # two calls; parallel_tool_calls false keeps the first
    two = {"structured_outputs": {"regex": TWO_CALLS}, "tool_choice": "auto", "max_tokens": 160}
    assert len(calls_of(chat(served, **two)["choices"][0]["message"])) == 2
    one = chat(served, parallel_tool_calls=False, **two)["choices"][0]
    assert calls_of(one["message"]) == [{"name": "clock", "arguments": '{"zone": "utc"}'}]
    assert one["message"]["content"] is None


def test_auto_without_a_call_is_plain_text_with_special_tokens_kept(served):
    tok = served.tokenizer
    out = hf_greedy(served.checkpoint, [prompt_ids(tok, MESSAGES)], 8)[0]
    want = tok.decode(out, skip_special_tokens=False)
    assert "<tool_call>" not in want
    got = chat(served, max_tokens=8, ignore_eos=True)["choices"][0]
    assert got["message"] == {"role": "assistant", "content": want} and got["finish_reason"] == "length"
    assert streamed(chat(served, max_tokens=8, ignore_eos=True, stream=True)) == (want, [], "length")


def test_a_grammar_compiling_at_the_front_holds_up_no_other_request(served, monkeypatch):
    """The front compiles a request's structured output (here a named function's schema) on a worker thread: while
    it compiles, another request is answered (before, the compile ran on the event loop and held up every
    request); then the first is answered too."""
    import threading

    admission, started, go = served.llm.admission, threading.Event(), threading.Event()
    real = admission.check_structured

    def slow(params):
        if params.structured_outputs is not None:
            started.set()
            assert go.wait(120), "the test never let the compile end"
        return real(params)

    monkeypatch.setattr(admission, "check_structured", slow)
    named, answers = {"type": "function", "function": {"name": "weather"}}, []
    first = threading.Thread(target=lambda: answers.append(chat(served, tool_choice=named, max_tokens=4)))
    first.start()
    try:
        assert started.wait(120)
        plain = chat(served, tool_choice="none", max_tokens=4)        # answered while the grammar compiles
        assert plain["choices"][0]["finish_reason"] == "length" and not answers
    finally:
        go.set()
        first.join(timeout=120)
    assert answers and answers[0]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "weather"


def test_earlier_calls_and_tool_results_reach_the_template(served):
    tok = served.tokenizer
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "clock", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call-1"}]
    # what the template must see: the arguments as an object, the content as text
    seen = [MESSAGES[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "clock", "arguments": {"zone": "utc"}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call-1"}]
    got = chat(served, messages=history, tool_choice="none", max_tokens=1, return_token_ids=True)
    assert got["prompt_token_ids"] == prompt_ids(tok, seen)
    assert "tool_calls" not in got["choices"][0]["message"]
    code, data = post(served, "/tokenize", {"model": MODEL, "messages": history, "tools": TOOLS})
    assert code == 200 and data["tokens"] == prompt_ids(tok, seen)
    # arguments that are not a JSON object (a call cut short) reach the template as {}, as vLLM's do
    for bad in ('{"zone": "ut', "[1]", "[" * 5000):
        history[1]["tool_calls"][0]["function"]["arguments"] = bad
        seen[1]["tool_calls"][0]["function"]["arguments"] = {}
        code, data = post(served, "/tokenize", {"model": MODEL, "messages": history, "tools": TOOLS})
        assert code == 200 and data["tokens"] == prompt_ids(tok, seen), bad


BAD = [
    ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
    ({"tools": []}, "tools", "empty"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "twice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "required", "guided_json": WEATHER}, "guided_json", "pass one of them"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tool_choice", ""),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"$defs": [1]}}}],
      "tool_choice": "required"}, "tools", "$defs"),
    ({"functions": [{"name": "f"}]}, "functions", "pass them as tools"),
    ({"function_call": "auto"}, "function_call", "pass tool_choice"),
]


@pytest.mark.parametrize("fields,param,words", BAD)
def test_bad_tool_fields_are_400s_naming_the_field(served, fields, param, words):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **fields}
    code, data = post(served, "/v1/chat/completions", {k: v for k, v in body.items() if v is not None})
    # (pydantic names the union member it tried last after the field: tool_choice.literal[...])
    assert code == 400 and data["error"]["param"].startswith(param) and words in data["error"]["message"], data


def test_auto_needs_the_servers_parser():
    from launch.frontend.api_server import build_app
    app = build_app(MODEL, "/models/tiny", access_log=False)       # no --enable-auto-tool-choice
    for fields in ({}, {"tool_choice": "auto"}):
        body = json.dumps({"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **fields}).encode()
        status, data = call(app, "POST", "/v1/chat/completions", body)
        assert status == 400 and data["error"]["param"] == "tool_choice", data
        assert "--enable-auto-tool-choice" in data["error"]["message"], data
    # the other choices do not need it (503: the app has no engine, so the request got past the tool checks)
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}).encode()
    assert call(app, "POST", "/v1/chat/completions", body)[0] == 503


# text -> (content, [(name, arguments)], finish_reason) of "auto"'s answer when the engine says "stop", by hand
AUTO = {
    'plain text, no calls': ('plain text, no calls', [], "stop"),
    'Let me look.<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>':
        ("Let me look.", [("a", '{"x": 1}')], "tool_calls"),
    '\n \n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
    '<tool_call>{"name": "b", "arguments": {"y": "é"}}':
        (None, [("a", "{}"), ("b", '{"y": "é"}')], "tool_calls"),
    '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>':                        # not JSON
        ('<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>', [], "stop"),
    'x <tool_call>{"name": "a"}</tool_call>': ('x <tool_call>{"name": "a"}</tool_call>', [], "stop"),   # no arguments
    'x <tool_call>["a"]</tool_call> <tool_call': ('x <tool_call>["a"]</tool_call> <tool_call', [], "stop"),
    'almost <tool_cal': ('almost <tool_cal', [], "stop"),
    '  <tool_call>' + "[" * 5000: ('  <tool_call>' + "[" * 5000, [], "stop"),               # too deep for json
    '  ': ('  ', [], "stop"),
    '<tool_call>{"name": "a", "arguments": {"x": "\\ud800é"}}':              # a lone surrogate: escaped
        (None, [("a", '{"x": "\\ud800\\u00e9"}')], "tool_calls"),
    '<tool_call>{"name": "a", "arguments": {"s": "h\\u00e9 \\ud83d\\ude00\\n", "n": [1.50, 2e3, -0]}}</tool_call>':
        (None, [("a", '{"s": "hé 😀\\n", "n": [1.5, 2000.0, 0]}')], "tool_calls"),
    '<tool_call>{"arguments": {"x": 1}, "name": "a"}</tool_call>': (None, [("a", '{"x": 1}')], "tool_calls"),
}
# the same for the deepseek_v3 parser: DeepSeek-V3's markers (special tokens of its tokenizer)
DS, CALL, SEP, END, ALL_END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                               "<｜tool▁calls▁end｜>")
DEEPSEEK = {
    f'Sure.{DS}{CALL}function{SEP}weather\n```json\n{{"city": "paris"}}\n```{END}{ALL_END}':
        ("Sure.", [("weather", '{"city": "paris"}')], "tool_calls"),
    f'{DS}{CALL}function{SEP}a\n```json\n{{}}\n```{END}{CALL}function{SEP}b\n```json\n[1, 2]\n```{END}{ALL_END}':
        (None, [("a", "{}"), ("b", "[1, 2]")], "tool_calls"),
    f'x{DS}{CALL}function{SEP}a\n```json\n{{"cut': ("x", [], "stop"),      # no whole call: dropped, as vLLM
    'no calls <｜tool▁calls': ('no calls <｜tool▁calls', [], "stop"),
    f'{DS}{CALL}function{SEP}a\n```json\n{{\n"x": 1}}\n```{END}{CALL}function{SEP}b\n```json\n{{"y": 2}}\n```'
    f'{END}{ALL_END}': (None, [("b", '{"y": 2}')], "tool_calls"),        # a call over two lines: dropped
}
# the same for the glm45 parser, whose calls' values take the types of the tools' schemas (vLLM's rules, by hand)
GLM_TOOLS = {"weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}, "hours": {"type": "array"},
    "note": {"type": ["null", "string"]}, "ratio": {"type": "number"}, "mode": {"enum": [1, "x"]},
    "opt": {"anyOf": [{"type": "object"}, {"type": "null"}]}, "code": {"type": "str"}, "flag": {"type": "Bool"},
    "f": {"type": " float "}}}, "clock": {}}
GLM = {
    'Let me check.\n<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>'
    '\n<arg_value>3</arg_value>\n</tool_call>':
        ("Let me check.\n", [("weather", '{"city": "Paris", "days": 3}')], "tool_calls"),
    '<tool_call>weather<arg_key>metric</arg_key><arg_value>True</arg_value><arg_key>hours</arg_key><arg_value>[1, 2]'
    '</arg_value><arg_key> note </arg_key><arg_value>null</arg_value><arg_key>ratio</arg_key><arg_value>2.0</arg_value>'
    '<arg_key>extra</arg_key><arg_value>7</arg_value><arg_key>opt</arg_key><arg_value>{"a": 1}</arg_value></tool_call>':
        (None, [("weather", '{"metric": true, "hours": [1, 2], "note": null, "ratio": 2, "extra": "7", '
                             '"opt": {"a": 1}}')], "tool_calls"),
    '<tool_call>weather<arg_key>days</arg_key><arg_value>three</arg_value><arg_key>ratio</arg_key><arg_value>1e999'
    '</arg_value><arg_key>mode</arg_key><arg_value>1</arg_value><arg_key>city</arg_key><arg_value> 5 </arg_value>'
    '<arg_key>metric</arg_key><arg_value>0</arg_value><arg_key>opt</arg_key><arg_value>NULL</arg_value></tool_call>':
        (None, [("weather", '{"days": "three", "ratio": "1e999", "mode": 1, "city": " 5 ", "metric": false, '
                             '"opt": null}')], "tool_calls"),
    '<tool_call>nope<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>\n<tool_call> clock \n</tool_call>\n'
    '<tool_call>weather<arg_key>city</arg_key><arg_value>Ro':
        (None, [("clock", "{}"), ("weather", "{}")], "tool_calls"),        # unknown name dropped, unclosed value too
    'Hi <tool_call>nope</tool_call>': ("Hi ", [], "stop"),
    '<tool_call>weather<arg_key>code</arg_key><arg_value>007</arg_value><arg_key>flag</arg_key><arg_value>1'
    '</arg_value><arg_key>f</arg_key><arg_value>2.0</arg_value></tool_call>':     # vLLM's type names: any case, aliases
        (None, [("weather", '{"code": "007", "flag": true, "f": 2}')], "tool_calls"),
    'A<tool_call>clock</tool_call>B': ("AB", [("clock", "{}")], "tool_calls"),
    'almost <tool_c': ("almost <tool_c", [], "stop"),
}
# the same for the mistral parser: before v11 a JSON array after [TOOL_CALLS], from v11 NAME[ARGS]{...} (vLLM's rules)
MISTRAL = {
    'Sure.[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "paris"}}, {"name": "clock", "arguments": '
    '"{\\"zone\\": \\"utc\\"}"}]':
        ("Sure.", [("weather", '{"city": "paris"}'), ("clock", '{"zone": "utc"}')], "tool_calls"),
    '[TOOL_CALLS]{"name": "clock"} and more': (None, [("clock", "{}")], "tool_calls"),
    '[TOOL_CALLS][1, {"arguments": {"a": 1}}, {"x": 2}]': (None, [("", '{"a": 1}')], "tool_calls"),
    'x[TOOL_CALLS][1, 2]': ('x[TOOL_CALLS][1, 2]', [], "stop"),
    '[TOOL_CALLS] [oops [{"name": "a", "arguments": {}}]': (None, [("a", "{}")], "tool_calls"),
    'Hi[TOOL_CALLS]weather[ARGS]{"city": "rome"}[TOOL_CALLS]clock[ARGS]{} trailing':
        ("Hi", [("weather", '{"city": "rome"}'), ("clock", "{}")], "tool_calls"),
    '[TOOL_CALLS]clock{"zone": ': (None, [("clock", '{"zone":')], "tool_calls"),
    ' [TOOL_CALLS][TOOL_CALLS]clock': (None, [("clock", "{}")], "tool_calls"),
    'almost [TOOL_CA': ("almost [TOOL_CA", [], "stop"),
    ' \n[TOOL_CALLS] clock [ARGS] {"zone": "utc"}': (None, [("clock", '{"zone": "utc"}')], "tool_calls"),
    ' [TOOL_CALLS] [{"name": "a", "arguments": {"b": [1, 2.0]}}, {"name": "c", "arguments": {}}]':
        (None, [("a", '{"b": [1, 2.0]}'), ("c", "{}")], "tool_calls"),
}
# (mode, text) -> the same, for a named function "f" and for "required"
FORCED = {
    ("named", '{"x": 1}'): ("", [("f", '{"x": 1}')], "stop"),
    ("named", '  \n'): ("", [], "stop"),
    ("required", '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'):
        ("", [("f", '{"x": 1}'), ("g", "{}")], "tool_calls"),
    ("required", '[{"name": "f", "param'): ("", [], "stop"),
}
CASES = ([("auto", text, want) for text, want in AUTO.items()] + [(m, t, w) for (m, t), w in FORCED.items()]
         + [("deepseek_v3", text, want) for text, want in DEEPSEEK.items()]
         + [("glm45", text, want) for text, want in GLM.items()]
         + [("mistral", text, want) for text, want in MISTRAL.items()])


def splits(text: str):
    """Ways a stream may cut text: at every point in steps of 1, 3 or all of it, each also with an empty last
    piece (the EOS that ends a choice adds no text)."""
    for cut in range(len(text) + 1) if len(text) < 200 else (0, 7, len(text)):
        for step in (1, 3, len(text) + 1):
            pieces = [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]
            yield pieces
            yield pieces + [""]


# texts that begin a call which is then not one (not JSON after all; cut short; a second line): a stream that
# sent part of it cannot take it back. text -> what a stream that sent it says (by hand; vLLM's streams do so):
# its content (no more than went out before the call), its calls (each one's arguments begin these), and
# finish_reason "tool_calls" as the engine stopped; the answer's calls after the broken one come after it
BROKEN = {'<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>': (None, [("a", '{"x": 1}')], "tool_calls"),
          f'x{DS}{CALL}function{SEP}a\n```json\n{{"cut': ("x", [("a", '{"cut')], "tool_calls"),
          f'{DS}{CALL}function{SEP}a\n```json\n{{\n"x": 1}}\n```{END}{CALL}function{SEP}b\n```json\n{{"y": 2}}\n```'
          f'{END}{ALL_END}': (None, [("a", "{"), ("b", '{"y": 2}')], "tool_calls")}
# texts whose calls the stream does not follow (keys in another order, Mistral's lone object, ...): they come
# whole at the end; every other text's first call opens before the stream's last piece
WHOLE = {'[TOOL_CALLS]{"name": "clock"} and more', '[TOOL_CALLS][1, {"arguments": {"a": 1}}, {"x": 2}]',
         '[TOOL_CALLS] [oops [{"name": "a", "arguments": {}}]', ' [TOOL_CALLS][TOOL_CALLS]clock',
         '<tool_call>{"arguments": {"x": 1}, "name": "a"}</tool_call>'}


@pytest.mark.parametrize("mode,text,want", CASES)
def test_tool_answers_and_every_split_of_their_stream_say_the_same(mode, text, want):
    plan = ToolPlan("auto", parser=PARSERS[mode], schemas=GLM_TOOLS) if mode in PARSERS else \
        ToolPlan(mode, "f" if mode == "named" else None)
    message, finish = plan.message(text, "stop")
    got = (message["content"], [(c["function"]["name"], c["function"]["arguments"])
                                for c in message.get("tool_calls", [])], finish)
    assert got == want
    for pieces in splits(text):
        chunks = stream_chunks(plan, pieces)
        content, calls, finish_s = streamed(chunks)
        if text in BROKEN and [c["name"] for c in calls] != [c[0] for c in want[1]]:
            broken = BROKEN[text]
            assert (content or None, finish_s) == (broken[0], broken[2]), pieces
            assert [c["name"] for c in calls] == [c[0] for c in broken[1]], pieces
            assert all(b[1].startswith(c["arguments"]) for c, b in zip(calls, broken[1])), pieces
        else:
            assert (content or None, [(c["name"], c["arguments"]) for c in calls], finish_s) == (
                want[0] or None, want[1], want[2]), pieces
        if want[1] and mode != "named":     # content never holds what starts a call, even in part
            assert all(plan.parser.start[0] not in (ch["choices"][0]["delta"].get("content") or "") for ch in chunks)
    if mode != "named" and (want[1] or text in BROKEN) and text not in WHOLE:    # calls go out as they come
        chunks = stream_chunks(plan, list(text) + [""])
        sent = [(i, c) for i, ch in enumerate(chunks) for c in ch["choices"][0]["delta"].get("tool_calls", [])]
        assert "id" in sent[0][1] and sent[0][0] < len(text), text      # the first call opens before the end
        early = "".join(c["function"].get("arguments", "") for i, c in sent if i < len(text) and c["index"] == 0)
        assert len(early) >= min(2, len((BROKEN[text][1] if text in BROKEN else want[1])[0][1])), sent


def test_a_call_cut_short_ends_length_with_no_more_content():
    """A stream that sent part of a call cut short by max_tokens cannot take it back; it ends "length" (vLLM's),
    not "tool_calls", and does not send the call's text again as content (the unstreamed answer's)."""
    text = 'Hi<tool_call>{"name": "a", "arguments": {"x": '
    plan = ToolPlan("auto")
    assert plan.message(text, "length") == ({"role": "assistant", "content": text}, "length")
    s = plan.stream()
    deltas = [s.add(c, final=False) for c in text] + [s.add("", final=True)]
    chunks = [{"choices": [{"delta": d, "finish_reason": None}]} for d in deltas]
    chunks[-1]["choices"][0]["finish_reason"] = s.finish_reason("length")
    content, calls, finish = streamed(chunks)
    assert (content, [(c["name"], c["arguments"]) for c in calls], finish) == ("Hi", [("a", '{"x": ')], "length")


def test_call_ids_take_the_parsers_form():
    """Mistral's chat templates refuse a call sent back unless its id is 9 letters and digits (vLLM answers such
    ids under its mistral parser); the others are vLLM's chatcmpl-tool-<hex>, in every mode."""
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}]'
    for parser, ok in (("mistral", lambda i: len(i) == 9 and i.isalnum()),
                       ("hermes", lambda i: re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", i))):
        for mode, out in (("auto", text if parser == "mistral" else '<tool_call>{"name": "a", "arguments": {}}'),
                          ("named", "{}")):
            plan = ToolPlan(mode, "a" if mode == "named" else None, parser=PARSERS[parser])
            ids = {plan.message(out, "stop")[0]["tool_calls"][0]["id"] for _ in range(20)}
            s = plan.stream()
            ids.add(s.add(out, final=True)["tool_calls"][0]["id"])
            assert len(ids) == 21 and all(ok(i) for i in ids), ids


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    message, finish = ToolPlan("auto", parallel=False).message(text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"] and finish == "tool_calls"
    for pieces in splits(text):
        content, calls, finish = streamed(stream_chunks(ToolPlan("auto", parallel=False), pieces))
        assert (content, [c["name"] for c in calls], finish) == ("", ["a"], "tool_calls"), pieces
    assert hermes_calls(text, {})[1][1].name == "b"
