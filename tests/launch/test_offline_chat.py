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
