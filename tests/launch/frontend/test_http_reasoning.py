"""Reasoning in chat answers (--reasoning-parser, launch/frontend/reasoning.py and answer.py), on an in-process server
(the app on uvicorn in a thread, attached to one `LLM` on 1+1 spawned ranks) with the deepseek_r1 parser, over a
tiny checkpoint whose tokenizer has "<think>" and "</think>" tokens.

Oracle: transformers' greedy tokens for the chat template's ids, with the request's logit_bias on "</think>" added
by the test's own logits processor (a bias that makes the random model write "</think>" early), split by the test
at the first "</think>" as vLLM's deepseek_r1 parser splits. Streamed answers must say what unstreamed ones say."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from launch import LLM
from launch.frontend.reasoning import ReasoningPlan, gate_of
from tests.conftest import hf_model
from tests.launch.frontend.in_process import serving
from tests.launch.frontend.test_http_logprobs import post
from tests.launch.frontend.test_http_tools import streamed

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Hello experts"}]
MAX_NEW = 12
BIAS = 2.0     # on "</think>": the tiny model writes one token of reasoning, then "</think>"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with thinking_server(tmp_path_factory) as s:
        yield s


@contextlib.contextmanager
def thinking_server(tmp_path_factory):
    """An in-process server (hermes tools, the deepseek_r1 parser) over a tiny checkpoint with think tokens."""
    from transformers import AutoTokenizer

    from models.tiny import TINY_VOCAB, make_tiny_checkpoint, save_tiny_tokenizer

    path = str(tmp_path_factory.mktemp("thinking"))
    make_tiny_checkpoint("qwen3_moe", path, with_tokenizer=False, vocab_size=TINY_VOCAB + 4)
    save_tiny_tokenizer(path, TINY_VOCAB)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])      # as DeepSeek-R1's and Qwen3's tokenizers have them (not special)
    tok.save_pretrained(path)
    with LLM(path, attention_ranks=1, expert_ranks=1, max_model_len=256, max_num_seqs=4) as llm, \
            serving(llm, path, MODEL, tool_parser="hermes", reasoning_parser="deepseek_r1") as (port, _):
        class Served:
            tokenizer = llm.tokenizer
            hf = hf_model(path)
            end = tok.convert_tokens_to_ids("</think>")
            checkpoint = path
        Served.port = port
        yield Served


def oracle(served, bias: float, tools: list | None = None, messages: list | None = None) -> tuple[list[int], str]:
    """transformers' greedy output tokens (and their text) with `bias` added to "</think>"'s logit; tools: the chat
    template's; messages: the conversation (MESSAGES)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    tok = served.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages or MESSAGES, tools=tools, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)

    class Bias(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, served.end] += bias
            return scores

    with torch.no_grad():
        out = served.hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, logits_processor=LogitsProcessorList([Bias()]))
    out = out[0, len(ids):].tolist()
    return out, tok.decode(out)


def chat(served, bias: float, **fields):
    code, data = post(served, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": MAX_NEW, "ignore_eos": True,
        "logit_bias": {str(served.end): bias}, **fields})
    assert code == 200, data
    return data


def streamed_reasoning(chunks: list[dict]) -> str:
    return "".join(c["delta"].get("reasoning") or "" for ch in chunks for c in ch["choices"])


@pytest.mark.parametrize("bias", [BIAS, 0.0])
def test_reasoning_is_the_text_before_think_end(served, bias):
    out, text = oracle(served, bias)
    if bias:
        assert served.end in out and out.index(served.end) < MAX_NEW - 1     # content follows it
        reasoning, content = text[:text.index("</think>")], text[text.index("</think>") + len("</think>"):]
        num = out.index(served.end)
    else:
        assert served.end not in out      # cut short while thinking: all of it is reasoning
        reasoning, content, num = text, None, MAX_NEW
    got = chat(served, bias, logprobs=True)
    c = got["choices"][0]
    assert c["message"] == {"role": "assistant", "content": content, "reasoning": reasoning}
    assert got["usage"]["completion_tokens_details"] == {"reasoning_tokens": num}
    assert len(c["logprobs"]["content"]) == MAX_NEW and c["finish_reason"] == "length"
    chunks = chat(served, bias, stream=True, stream_options={"include_usage": True})
    assert streamed_reasoning(chunks) == reasoning
    assert streamed(chunks) == (content or "", [], "length")
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": num}


def test_include_reasoning_false_leaves_it_the_logprobs_and_the_token_ids_out(served):
    out, text = oracle(served, BIAS)
    content = text[text.index("</think>") + len("</think>"):]
    got = chat(served, BIAS, include_reasoning=False, logprobs=True, return_token_ids=True)
    c = got["choices"][0]
    assert c["message"] == {"role": "assistant", "content": content, "reasoning": None} and c["logprobs"] is None
    assert "token_ids" not in c and got["prompt_token_ids"]      # the prompt's ids show no reasoning
    chunks = chat(served, BIAS, include_reasoning=False, stream=True, logprobs=True, return_token_ids=True)
    assert streamed_reasoning(chunks) == "" and streamed(chunks)[0] == content
    parts = [c for ch in chunks for c in ch["choices"]]
    assert all(c["logprobs"] is None and "token_ids" not in c for c in parts)
    # no chunk for the hidden reasoning's tokens: each carries text or the finish (or is the role's first chunk)
    assert all(c["delta"].get("content") or c["finish_reason"] or c["delta"].get("role") for c in parts), parts


def test_tools_are_looked_for_in_the_content_only(served):
    """auto tools beside the reasoning parser: an answer cut short while reasoning has no content (null, as without
    tools) and no calls; the reasoning, streamed or not, is the same as without tools."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    out, text = oracle(served, 0.0, tools)
    c = chat(served, 0.0, tools=tools)["choices"][0]
    assert c["message"] == {"role": "assistant", "content": None, "reasoning": text}
    chunks = chat(served, 0.0, tools=tools, stream=True)
    assert (streamed_reasoning(chunks), streamed(chunks)) == (text, ("", [], "length"))
    # a bias under which the model (with the tools in its prompt) writes "</think>" and then some content
    bias = next(b for b in (2.0, 2.5, 3.0, 3.5, 4.0, 5.0) if served.end in (o := oracle(served, b, tools)[0])
                and 0 < o.index(served.end) < MAX_NEW - 1)
    out, text = oracle(served, bias, tools)
    reasoning, content = text.split("</think>", 1)
    c = chat(served, bias, tools=tools)["choices"][0]
    assert c["message"] == {"role": "assistant", "content": content, "reasoning": reasoning}


def test_a_grammar_binds_once_the_reasoning_has_ended(served):
    """Structured outputs beside a reasoning parser bind after "</think>" (vLLM's rule): the reasoning is free, the
    content follows the grammar; oracle: transformers' greedy output with the test's own matcher gated the same way."""
    from transformers import AutoTokenizer

    from tests.launch.test_structured_outputs import _hf_constrained
    tok = served.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    regex = r"[0-9]{3}-[a-z]{2}"
    grammar = lambda c: c.compile_regex(regex)  # noqa: E731
    out = _hf_constrained(served.hf, AutoTokenizer.from_pretrained(served.checkpoint), ids, grammar, MAX_NEW,
                          {served.end: BIAS}, after=served.end)
    assert out[-1] == tok.eos_token_id and served.end in out
    text = tok.decode(out[:-1])
    reasoning, content = text.split("</think>", 1)
    assert re.fullmatch(regex, content), content
    got = chat(served, BIAS, ignore_eos=False, structured_outputs={"regex": regex})["choices"][0]
    assert got["message"] == {"role": "assistant", "content": content, "reasoning": reasoning}
    assert got["finish_reason"] == "stop"
    chunks = chat(served, BIAS, ignore_eos=False, stream=True, structured_outputs={"regex": regex})
    assert (streamed_reasoning(chunks), streamed(chunks)) == (reasoning, (content, [], "stop"))
    # /v1/completions on the same ids: the grammar binds after "</think>" too (the prompt leaves thinking open)
    code, data = post(served, "/v1/completions", {"model": MODEL, "prompt": ids, "temperature": 0,
                                                  "max_tokens": MAX_NEW, "logit_bias": {str(served.end): BIAS},
                                                  "structured_outputs": {"regex": regex}})
    assert code == 200 and data["choices"][0]["text"] == text, data


# text -> (reasoning, content) as vLLM's deepseek_r1 parser splits it, written out by hand
SPLITS = {
    "<think>abc</think>xyz": ("abc", "xyz"),
    "abc</think>": ("abc", None),
    "abc": ("abc", None),
    "</think>x</think>y": ("", "x</think>y"),
    "<thi": ("<thi", None),
    "ab</thin": ("ab</thin", None),
    "<think>": ("", None),
    "": ("", None),
}


# the same as vLLM 0.32's qwen3 and glm45 parsers split it (its parser engine's rules), by hand: a "<tool_call>"
# ends the reasoning and stays as the content's start; the reasoning loses its trailing whitespace and any "<think>";
# empty is null; the content loses any "</think>"
ENGINE_SPLITS = {
    "<think>abc \n</think>\nxyz": ("abc", "\nxyz"),
    "abc  <tool_call>{}</tool_call>": ("abc", "<tool_call>{}</tool_call>"),
    "a<tool_call>b</think>c": ("a", "<tool_call>bc"),
    "<think>a<think>b</think>c</think>d</thi": ("ab", "cd</thi"),       # "<think>" in reasoning, "</think>" after it
    "\n<think>a</think>b": ("\na", "b"),
    "a</think></think>": ("a", None),
    "a<thi": ("a<thi", None),
    "x<tool_<think>call>y": ("x<tool_call>y", None),    # a tag that a dropped "<think>" makes is no tag (vLLM's too)
    "x</<think>think>y": ("x</think>y", None),
    "<th<think>ink>a": ("<think>a", None),
    "a</think></thi</think>nk>": ("a", "</think>"),
    "a <think> \n<think>": ("a", None),
    "a</think>b<tool_call>c": ("a", "b<tool_call>c"),
    "a \n b  ": ("a \n b", None),
    "<think>\n\n</think>x": (None, "x"),
    "<tool_call>": (None, "<tool_call>"),
    "ab<tool_ca": ("ab<tool_ca", None),
    "": (None, None),
}


@pytest.mark.parametrize("engine,text,want", [(False, t, w) for t, w in SPLITS.items()]
                         + [(True, t, w) for t, w in ENGINE_SPLITS.items()])
def test_every_split_of_a_stream_says_what_the_answer_says(engine, text, want):
    plan = ReasoningPlan(thinking=True, include=True, start_id=1, end_id=2, tool_start="<tool_call>" if engine
                         else None, engine=engine)
    assert plan.split(text) == want
    cuts = [[text[i:i + step] for i in range(0, len(text), step)] for step in (1, 2, 5)]
    cuts += [[p for p in re.split(r"(<think>|</think>)", text) if p]]      # each tag a piece of its own
    for cut in cuts:
        for tail in ([], [""]):
            pieces = cut + tail or [""]
            s = plan.stream()
            parts = [s.add(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
            reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
            assert (reasoning or (None if engine else ""), content or None) == want, (pieces, parts)


@pytest.mark.parametrize("kwargs,effort,want", [
    ({}, None, True), ({"enable_thinking": False}, None, False), ({"thinking": False}, None, False),
    ({"thinking": False, "enable_thinking": True}, None, True), ({"thinking": True}, "none", True),
    ({}, "none", False), ({}, "high", True), ({"enable_thinking": 0}, None, False)])
def test_glm45_thinks_unless_its_switches_say_not(kwargs, effort, want):
    """vLLM's GLM rule: on when neither thinking nor enable_thinking is given, else on when either is true
    (reasoning_effort "none" stands for enable_thinking false, another effort for true, as the template sees it)."""
    from launch.frontend.reasoning import thinking_of
    assert thinking_of("glm45", kwargs, effort) is want


def test_glm45_counts_and_gates_by_its_own_tokens():
    class Body:
        chat_template_kwargs, include_reasoning, reasoning_effort = None, True, None

    class Tok:
        @staticmethod
        def get_vocab():
            return {"<think>": 7, "</think>": 8, "<tool_call>": 9, "<|user|>": 50, "<|assistant|>": 51}

        @staticmethod
        def decode(ids, skip_special_tokens):
            return {7: "<think>", 8: "</think>", 9: "" if skip_special_tokens else "<tool_call>"}.get(ids[0], "x")

    plan = ReasoningPlan.of(Body, "glm45", Tok)
    assert plan.num_tokens([7, 1, 2, 9, 3, 8]) == 2 and plan.num_tokens([7, 1, 8, 9]) == 1
    assert plan.special     # the tool start would drop from the text, where the split looks for it
    assert plan.gate([7, 1, 8, 50, 5, 51]) == 8 and plan.gate([50, 5, 51, 7, 8]) is None     # GLM's turn markers
    assert ReasoningPlan.of(Body, "deepseek_r1", Tok).num_tokens([7, 1, 2, 9, 3, 8]) == 4


@pytest.mark.parametrize("text,want", [
    ("Let me see.\n<tool_call>clock\n<arg_key>zone</arg_key>\n<arg_value>utc</arg_value>\n</tool_call>",
     ("Let me see.", None, [("clock", '{"zone": "utc"}')], "tool_calls")),
    ("hm</think>\nIt is <tool_call>clock</tool_call>", ("hm", "\nIt is ", [("clock", "{}")], "tool_calls")),
    ("hm</think>no call", ("hm", "no call", [], "stop"))])
def test_a_glm45_call_that_ends_the_reasoning_is_a_call(text, want):
    """GLM-4.5 may call a tool straight from its thinking: the call ends the reasoning and is answered as a call,
    unstreamed and in every split of the stream (vLLM's glm45 parsers, by hand)."""
    from launch.frontend.answer import ChatAnswer
    from launch.frontend.tool_parsers import PARSERS
    from launch.frontend.tools import ToolPlan
    from tests.launch.frontend.test_http_tools import splits, stream_chunks, streamed

    answer = ChatAnswer(ToolPlan("auto", parser=PARSERS["glm45"], schemas={"clock": {}}),
                        ReasoningPlan(True, True, 1, 2, tool_start="<tool_call>", engine=True))
    message, finish = answer.message(text, "stop")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert (message["reasoning"], message["content"], calls, finish) == want
    for pieces in splits(text):
        chunks = stream_chunks(answer, pieces)
        reasoning = "".join(ch["choices"][0]["delta"].get("reasoning", "") for ch in chunks)
        content, got_calls, got_finish = streamed(chunks)
        assert (reasoning, content or None, [(c["name"], c["arguments"]) for c in got_calls], got_finish) == want


def test_under_a_grammar_only_think_end_ends_the_reasoning():
    """A grammar (here a named tool choice's) binds after "</think>" only, so a "<tool_call>" before it is reasoning:
    the constrained output after "</think>" is the answer (before, the unconstrained text from "<tool_call>" was read
    as the named call's arguments)."""
    from launch.frontend.chat import ChatCompletionRequest

    class Tok:
        @staticmethod
        def get_vocab():
            return {"<think>": 7, "</think>": 8, "<tool_call>": 9}

        @staticmethod
        def decode(ids, skip_special_tokens):
            return {7: "<think>", 8: "</think>", 9: "<tool_call>"}[ids[0]]

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = 'plan<tool_call>{"name": "f"}</tool_call> more</think>{"x": 1}'
    for parser in ("qwen3", "glm45"):
        for choice, want in (({"type": "function", "function": {"name": "f"}}, ('plan<tool_call>{"name": "f"}'
                                                                                 '</tool_call> more', '{"x": 1}')),
                             ("auto", ("plan", text[4:].replace("</think>", "")))):
            body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                         tool_choice=choice)
            plan = ReasoningPlan.of(body, parser, Tok)
            assert plan.split(text) == want and plan.num_tokens([1, 9, 2, 8, 3]) == (3 if choice != "auto" else 1)


def test_qwen3_with_thinking_off_is_all_content():
    class Body:
        chat_template_kwargs = {"enable_thinking": False}
        include_reasoning = True
        reasoning_effort = None

    class Tok:
        @staticmethod
        def get_vocab():
            return {"<think>": 7, "</think>": 8}

        @staticmethod
        def decode(ids, skip_special_tokens):
            return "<think>" if ids == [7] else "</think>"

    plan = ReasoningPlan.of(Body, "qwen3", Tok)
    assert plan.split("a</think>b") == (None, "a</think>b") and plan.num_tokens([1, 8, 2]) == 0
    Body.chat_template_kwargs = None
    plan = ReasoningPlan.of(Body, "qwen3", Tok)
    assert plan.split("a</think>b") == ("a", "b") and plan.num_tokens([7, 1, 8, 2]) == 1
    assert ReasoningPlan.of(Body, "deepseek_r1", Tok).split("a</think>b") == ("a", "b")
    # where a grammar binds: after "</think>", unless the prompt's last think token closed the thinking already
    assert plan.gate([1, 7, 3]) == plan.gate([4]) == 8 and plan.gate([7, 3, 8, 4]) is None
    # qwen3 looks back no further than the turn: an earlier assistant turn's "</think>" does not count
    assert gate_of([7, 3, 8, 4, 50, 5], 7, 8, frozenset({50})) == 8 and gate_of([7, 3, 8, 4, 50, 5], 7, 8) is None
    Body.chat_template_kwargs = {"enable_thinking": False}
    assert ReasoningPlan.of(Body, "qwen3", Tok).gate([4]) is None
    Body.chat_template_kwargs, Body.include_reasoning = None, False     # hidden reasoning: bound from the start
    assert ReasoningPlan.of(Body, "qwen3", Tok).gate([4]) is None
    Body.reasoning_effort, Body.include_reasoning = "none", True     # vLLM: effort "none" turns thinking off
    assert ReasoningPlan.of(Body, "qwen3", Tok).split("a</think>b") == (None, "a</think>b")
    Body.chat_template_kwargs = {"enable_thinking": True}             # unless the kwargs say otherwise
    assert ReasoningPlan.of(Body, "qwen3", Tok).split("a</think>b") == ("a", "b")


def test_reasoning_effort_reaches_the_template_and_sets_enable_thinking():
    from launch.frontend.chat import ChatCompletionRequest
    from launch.frontend.tokens import template_kwargs

    class Tok:
        def apply_chat_template(self, conversation, tools=None, add_generation_prompt=False, tokenize=True, **kw):
            pass

    def kwargs(**fields) -> dict:
        return template_kwargs(Tok(), ChatCompletionRequest(messages=MESSAGES, **fields))
    assert kwargs() == {}
    assert kwargs(reasoning_effort="low") == {"reasoning_effort": "low", "enable_thinking": True}
    assert kwargs(reasoning_effort="none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert kwargs(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == {
        "reasoning_effort": "none", "enable_thinking": True}


def test_think_tokens_that_the_tokenizer_marks_special_keep_special_tokens_in_the_text(tmp_path):
    from transformers import AutoTokenizer

    from launch.frontend.answer import ChatAnswer
    from launch.frontend.reasoning import think_tokens
    from models.tiny import save_tiny_tokenizer
    save_tiny_tokenizer(tmp_path)
    plain, special = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    plain.add_tokens(["<think>", "</think>"])
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert think_tokens(plain)[2] is False and think_tokens(special)[2] is True
    assert think_tokens(AutoTokenizer.from_pretrained(tmp_path)) is None

    class Body:
        chat_template_kwargs, include_reasoning = None, True
    assert not ChatAnswer.of(None, ReasoningPlan.of(Body, "deepseek_r1", plain)).keeps_special_tokens
    assert ChatAnswer.of(None, ReasoningPlan.of(Body, "deepseek_r1", special)).keeps_special_tokens
