"""`LLM.chat` (vLLM's; launch/offline_chat.py): conversations through the checkpoint's chat template, then generate.
Oracle: transformers' own tokenizer renders each conversation (apply_chat_template, then encode without special
tokens, as vLLM does) and transformers' generate continues it greedily."""
from __future__ import annotations

import pytest
from conftest import hf_greedy
from transformers import AutoTokenizer

from launch import LLM, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "clock", "description": "the time",
                                           "parameters": {"type": "object", "properties": {}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello experts"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}],
]
CONTINUED = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Mixture-of"}]


def rendered(tok, conversation, **options) -> list[int]:
    return tok.encode(tok.apply_chat_template(conversation, tokenize=False, **options), add_special_tokens=False)


def test_chat_generates_from_the_chat_templates_ids(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [rendered(tok, c, add_generation_prompt=True) for c in CONVERSATIONS] + [
        rendered(tok, CONVERSATIONS[0], add_generation_prompt=True, tools=TOOLS),
        rendered(tok, CONTINUED, add_generation_prompt=False, continue_final_message=True)]
    expected = hf_greedy(path, prompts, 6)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(path, attention_ranks=1, expert_ranks=1) as llm:
        outs = llm.chat(CONVERSATIONS, params)                        # a list of conversations
        one = llm.chat(CONVERSATIONS[0], params, tools=TOOLS)         # one conversation, with tools
        cont = llm.chat(CONTINUED, params, add_generation_prompt=False, continue_final_message=True)
        with pytest.raises(ValueError, match=r"messages: messages\.0\.role"):
            llm.chat([{"role": "robot", "content": "hi"}], params)
        with pytest.raises(ValueError, match="continue_final_message"):
            llm.chat(CONTINUED, params, continue_final_message=True)       # with add_generation_prompt too
        with pytest.raises(ValueError, match="not a conversation"):
            llm.chat([], params)
    got = outs + one + cont
    assert [o.prompt_token_ids for o in got] == prompts
    assert [o.token_ids for o in got] == expected
    assert outs[0].text == tok.decode(expected[0], skip_special_tokens=True)
    # the rendered text comes back as the prompt (vLLM's RequestOutput.prompt)
    assert outs[1].prompt == tok.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)


# non-ASCII text and a backslash-quote, as real templates have (DeepSeek's markers, Qwen's tool-call JSON)
TEMPLATE = ("{% for m in messages %}‹｜{{ m['role'] }}｜>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}{{ \"<<assistant \\\"now\\\">>\" }}{% endif %}")


def test_a_chat_template_option_or_argument_replaces_the_checkpoints(tiny_checkpoint, tmp_path):
    """vLLM's --chat-template (the engine option: a file's path, or the template itself, as it is) and LLM.chat's
    chat_template argument (a path object too) render chats in place of the checkpoint's template; over HTTP the
    chat's prompt ids are the option's too. Oracle: transformers' apply_chat_template with the same template text."""
    from tests.launch.frontend.in_process import serving
    from tests.launch.frontend.test_http_logprobs import post

    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    ours = rendered(tok, CONVERSATIONS[1], add_generation_prompt=True, chat_template=TEMPLATE)
    assert ours != rendered(tok, CONVERSATIONS[1], add_generation_prompt=True)     # the oracle is not trivial
    expected = hf_greedy(path, [ours], 6)[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    with LLM(path, attention_ranks=1, expert_ranks=1, chat_template=str(file)) as llm:
        from_file = llm.chat(CONVERSATIONS[1], params)[0]
        with serving(llm, path, "tiny") as (port, _):
            class Served:
                pass
            Served.port = port
            code, body = post(Served, "/v1/chat/completions", {"model": "tiny", "messages": CONVERSATIONS[1],
                                                               "max_tokens": 6, "ignore_eos": True, "temperature": 0,
                                                               "return_token_ids": True})
    assert code == 200, body
    with LLM(path, attention_ranks=1, expert_ranks=1) as llm:
        inline = llm.chat(CONVERSATIONS[1], params, chat_template=TEMPLATE)[0]
        as_path = llm.chat(CONVERSATIONS[1], params, chat_template=file)[0]
        default = llm.chat(CONVERSATIONS[1], params)[0]
    assert from_file.prompt_token_ids == inline.prompt_token_ids == as_path.prompt_token_ids == ours
    assert body["prompt_token_ids"] == ours
    assert '<<assistant \\"now\\">>' not in from_file.prompt and '<<assistant "now">>' in from_file.prompt
    assert from_file.token_ids == inline.token_ids == body["choices"][0]["token_ids"] == expected
    assert from_file.prompt == tok.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True,
                                                       chat_template=TEMPLATE)
    assert default.prompt_token_ids == rendered(tok, CONVERSATIONS[1], add_generation_prompt=True)


def test_a_chat_template_that_cannot_be_read_or_compiled_is_refused_by_name(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match=r"chat_template='/no/such/template.jinja' looks like a file path, but it "
                                         r"cannot be read"):
        LLM(path, attention_ranks=1, expert_ranks=1, chat_template="/no/such/template.jinja")
    with pytest.raises(ValueError, match=r"chat_template='\{% for m in messages %\}' is not a Jinja template that "
                                         r"compiles"):
        LLM(path, attention_ranks=1, expert_ranks=1, chat_template="{% for m in messages %}")
