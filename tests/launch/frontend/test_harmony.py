"""GPT-OSS's harmony messages in chat answers (launch/frontend/harmony.py): the openai_gptoss reasoning parser and
the openai tool parser. The answers are written out by hand from vLLM 0.32's HarmonyParser rules (analysis is
reasoning; final, and commentary to no one, content; a message to a function a call; parts joined with "\\n"), and
every split of a stream must say what the unstreamed answer says."""
from __future__ import annotations

import pytest

from launch.frontend.answer import check_parsers, require_tokens
from launch.frontend.harmony import MARKERS, HarmonyAnswer, marker_ids
from launch.frontend.tool_parsers import PARSERS
from launch.frontend.tools import ToolPlan
from tests.launch.frontend.test_http_tools import splits, stream_chunks, streamed

A, F, S = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>", "<|end|><|start|>assistant"
# text -> (reasoning, content, [(name, arguments)], finish_reason) with both parsers, when the engine says "stop"
CASES = {
    f"{A}The user greets.{S}{F}Hello!": ("The user greets.", "Hello!", [], "stop"),
    f'{A}Need weather.{S}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{{"city":  "P"}}':
        ("Need weather.", None, [("get_weather", '{"city": "P"}')], "tool_calls"),
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.clock<|channel|>commentary json"
    "<|message|>{}<|call|>": (None, "Checking.", [("clock", "{}")], "tool_calls"),
    f"{A}a{S}{A}b{S}{F}x{S}{F}{S}{F}y": ("a\nb", "x\ny", [], "stop"),
    '<|channel|>analysis to=browser.search<|message|>{"q": 1}<|end|><|start|>assistant<|channel|>commentary '
    'to=functions.f <|constrain|>text<|message|>raw {args}': ('{"q": 1}', None, [("f", "raw {args}")], "tool_calls"),
    "<|channel|>commentary to=functions.f<|message|>{oops": (None, None, [("f", "{oops")], "tool_calls"),
    '{"a": 1}': (None, '{"a": 1}', [], "stop"),                      # no header: a grammar forced it
    f"{F}Hi{S}<|chan": (None, "Hi", [], "stop"),                     # cut in a header: dropped
    f"{A}think": ("think", None, [], "stop"),                         # cut in the reasoning
    f"{A}a <|e": ("a <|e", None, [], "stop"),                         # a marker's start that was not one
    F: (None, None, [], "stop"),
    f"{F}A<|end|><|start|>functions.f to=assistant<|channel|>commentary<|message|>B<|end|>": (None, "A", [], "stop"),
    "<|channel|>commentary to=python<|message|>print(1)<|end|><|start|>assistant<|channel|>weird<|message|>z":
        (None, None, [], "stop"),          # a built-in tool's call and an unknown channel are dropped
    "<|channel|>commentary to=<|constrain|>json<|message|>pre": (None, "pre", [], "stop"),   # no recipient: a preamble
    '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city":"Zürich", "n": [1.50, -0]}<|call|>':
        (None, None, [("f", '{"city": "Z\\u00fcrich", "n": [1.5, 0]}')], "tool_calls"),   # re-written as json.dumps
}


def answer(include: bool = True, parsed: bool = True, tools: bool = True, parallel: bool = True) -> HarmonyAnswer:
    plan = ToolPlan("auto", parallel=parallel, parser=PARSERS["hermes"]) if tools else None
    return HarmonyAnswer(parsed, include, plan)


def said(ans: HarmonyAnswer, text: str) -> tuple:
    message, finish = ans.message(text, "stop")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return message.get("reasoning", "absent"), message["content"], calls, finish


def streamed_said(ans: HarmonyAnswer, pieces: list[str]) -> tuple:
    chunks = stream_chunks(ans, pieces)
    reasoning = "".join(ch["choices"][0]["delta"].get("reasoning", "") for ch in chunks)
    content, calls, finish = streamed(chunks)
    if "a <|e" not in "".join(pieces):      # no marker, nor a part of one, reaches the client as text
        assert all("<|" not in ch["choices"][0]["delta"].get("content", "") + ch["choices"][0]["delta"].get(
            "reasoning", "") for ch in chunks), chunks
    return reasoning or None, content or None, [(c["name"], c["arguments"]) for c in calls], finish


@pytest.mark.parametrize("text", list(CASES))
def test_harmony_answers_and_every_split_of_their_stream_say_the_same(text):
    ans = answer()
    assert said(ans, text) == CASES[text]
    for pieces in splits(text):
        assert streamed_said(ans, pieces) == CASES[text], pieces
    if CASES[text][2]:      # a call opens when its header ends, and its arguments follow before the message ends
        chunks = stream_chunks(ans, list(text) + [""])
        sent = [(i, c) for i, ch in enumerate(chunks) for c in ch["choices"][0]["delta"].get("tool_calls", [])]
        assert "id" in sent[0][1] and sent[0][0] < text.rindex("<|message|>") + len("<|message|>"), sent
        assert len(sent) > 2 or len(CASES[text][2][0][1]) <= 2, sent


def test_what_the_server_does_not_parse_is_left_out():
    text = f'{A}hm{S}<|channel|>commentary to=functions.a<|message|>{{}}<|end|><|start|>assistant<|channel|>' \
           f'commentary to=functions.b<|message|>{{"x": 1}}<|end|><|start|>assistant{F}ok'
    cases = [  # (answer, what it says): no openai tool parser: no calls; no openai_gptoss: no reasoning field
        (answer(tools=False), ("hm", "ok", [], "stop")),
        (answer(parsed=False), ("absent", "ok", [("a", "{}"), ("b", '{"x": 1}')], "tool_calls")),
        (answer(include=False), (None, "ok", [("a", "{}"), ("b", '{"x": 1}')], "tool_calls")),
        (answer(parallel=False), ("hm", "ok", [("a", "{}")], "tool_calls")),
    ]
    for ans, want in cases:
        assert said(ans, text) == want
        for pieces in splits(text):
            got = streamed_said(ans, pieces)
            assert got == (None if want[0] == "absent" else want[0], *want[1:]), pieces
    # include_reasoning false hides the logprobs under either parser (vLLM's): they would show the analysis
    assert not answer(include=False).shows_logprobs and not answer(parsed=False, include=False).shows_logprobs
    assert answer(parsed=False).shows_logprobs


class Tok:
    """A tokenizer stand-in: the markers and a few words, each one token."""
    words = [*MARKERS, "analysis", "final", "commentary", "assistant", " to=functions.f", " json", "a", "b", "c"]

    @classmethod
    def get_vocab(cls):
        return {w: i for i, w in enumerate(cls.words)}

    @classmethod
    def decode(cls, ids, skip_special_tokens=False):
        return "".join(cls.words[i] for i in ids)


def test_reasoning_tokens_are_the_analysis_and_the_calls_text_tokens():
    """vLLM's count: the text tokens of analysis messages and of commentary messages to a recipient."""
    class Body:
        include_reasoning = True

    ans = HarmonyAnswer.of(Body, None, "openai_gptoss", None, Tok)
    v = Tok.get_vocab()
    text = ("<|channel|>", "analysis", "<|message|>", "a", "b", "<|end|>", "<|start|>", "assistant", "<|channel|>",
            "commentary", " to=functions.f", " json", "<|message|>", "c", "<|end|>", "<|start|>", "assistant",
            "<|channel|>", "commentary", "<|message|>", "a", "<|end|>", "<|start|>", "assistant", "<|channel|>",
            "final", "<|message|>", "b", "c")
    ids = [v[w] for w in text]
    assert ans.num_tokens(ids) == 3 and ans.usage_details([ids, ids[:4]]) == {
        "completion_tokens_details": {"reasoning_tokens": 4}}
    assert HarmonyAnswer.of(Body, None, None, "openai", Tok).usage_details([ids]) == {}
    # a stream's growing output (continuous_usage_stats) is counted on, not again from its start: each header is
    # decoded once however many times the usage is asked for, and each count is the whole prefix's
    decoded = []
    counting = HarmonyAnswer(True, True, None, lambda h: decoded.append(h) or Tok.decode(h), *marker_ids(Tok))
    grown = []
    for t in ids:
        grown.append(t)
        assert counting.usage_details([grown]) == {"completion_tokens_details": {
            "reasoning_tokens": ans.num_tokens(list(grown))}}
    assert len(decoded) == 4 == sum(w == "<|message|>" for w in text)


@pytest.mark.parametrize("tool,reasoning,ok", [
    ("openai", "openai_gptoss", True), ("openai", None, True), (None, "openai_gptoss", True),
    ("hermes", "qwen3", True), ("openai", "qwen3", False), ("hermes", "openai_gptoss", False)])
def test_the_harmony_parsers_take_each_other_or_none(tool, reasoning, ok):
    if ok:
        check_parsers(tool, reasoning)
    else:
        with pytest.raises(ValueError, match="harmony"):
            check_parsers(tool, reasoning)


def test_the_harmony_parsers_need_gpt_oss_tokens():
    require_tokens(Tok, "openai", None, "m")

    class Plain:
        @staticmethod
        def get_vocab():
            return {"<|start|>": 1}

    with pytest.raises(ValueError, match=r"'m' lacks <\|channel\|>"):
        require_tokens(Plain, None, "openai_gptoss", "m")


# over HTTP: a tiny GPT-OSS checkpoint whose tokenizer has the markers, on 1+1 spawned ranks, served with both
# harmony parsers; a regex structured output makes the random model write harmony (as GPT-OSS would) and the
# oracle is transformers' greedy output under the test's own matcher of that regex, read by the regex's groups
CALL = r'<\|channel\|>analysis<\|message\|>([a-z]{1,6})<\|end\|><\|start\|>assistant<\|channel\|>commentary ' \
       r'to=functions\.clock <\|constrain\|>json<\|message\|>(\{"zone": "(utc|cet)"\})'
CLOCK = [{"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from launch import LLM
    from models.tiny import TINY_VOCAB, make_tiny_checkpoint, save_tiny_tokenizer
    from tests.conftest import hf_model
    from tests.launch.frontend.in_process import serving

    path = str(tmp_path_factory.mktemp("harmony"))
    make_tiny_checkpoint("gpt_oss", path, with_tokenizer=False, vocab_size=TINY_VOCAB + len(MARKERS))
    save_tiny_tokenizer(path, TINY_VOCAB)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(list(MARKERS))
    tok.save_pretrained(path)
    with LLM(path, attention_ranks=1, expert_ranks=1, max_model_len=512, max_num_seqs=4) as llm, \
            serving(llm, path, "tiny", tool_parser="openai", reasoning_parser="openai_gptoss") as (port, _):
        class Served:
            tokenizer = llm.tokenizer
            hf = hf_model(path)
            markers = {m: tok.convert_tokens_to_ids(m) for m in MARKERS}
        Served.port = port
        yield Served


def test_a_served_gpt_oss_answer_splits_reasoning_and_calls(served):
    import re

    from tests.launch.frontend.test_http_logprobs import post
    from tests.launch.frontend.test_http_tools import prompt_ids
    from tests.launch.test_structured_outputs import _hf_constrained

    tok, messages = served.tokenizer, [{"role": "user", "content": "Hello experts"}]
    bias = {i: 5.0 for i in served.markers.values()}    # whole markers rather than their characters
    ids = prompt_ids(tok, messages, CLOCK)
    out = _hf_constrained(served.hf, tok, ids, lambda c: c.compile_regex(CALL), 128, bias)
    assert out[-1] == tok.eos_token_id
    out = out[:-1]
    thought, arguments, _ = re.fullmatch(CALL, tok.decode(out)).groups()
    body = [k for k, t in enumerate(out) if t == served.markers["<|message|>"]]
    assert len(body) == 2          # each marker one token: the reasoning tokens are the two messages' texts
    want_tokens = out.index(served.markers["<|end|>"]) - body[0] - 1 + len(out) - body[1] - 1
    request = {"model": "tiny", "messages": messages, "tools": CLOCK, "temperature": 0, "max_tokens": 128,
               "structured_outputs": {"regex": CALL}, "logit_bias": {str(t): v for t, v in bias.items()}}
    code, data = post(served, "/v1/chat/completions", request)
    assert code == 200, data
    c = data["choices"][0]
    assert (c["message"]["reasoning"], c["message"]["content"], c["finish_reason"]) == (thought, None, "tool_calls")
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in c["message"]["tool_calls"]] == [
        ("clock", arguments)]
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": want_tokens}
    code, chunks = post(served, "/v1/chat/completions", request | {"stream": True})
    assert code == 200
    content, calls, finish = streamed([ch for ch in chunks if ch["choices"]])
    reasoning = "".join(ch["choices"][0]["delta"].get("reasoning", "") for ch in chunks if ch["choices"])
    assert (reasoning, content, [(t["name"], t["arguments"]) for t in calls], finish) == (
        thought, "", [("clock", arguments)], "tool_calls")
    code, data = post(served, "/v1/chat/completions", request | {"include_reasoning": False})
    assert code == 200 and data["choices"][0]["message"]["reasoning"] is None, data
