"""vLLM's prompt and output shapes in `LLM.generate`: TextPrompt and TokensPrompt dicts (alone or in a list, with a
cache_salt that reaches the prefix cache) give transformers' greedy tokens, and each RequestOutput answers vLLM's
`prompt`, `prompt_token_ids`, `outputs[i]` and `finished`; keys this engine does not serve are refused by name."""
from __future__ import annotations

import pytest

from attention_nodes.sampling_params import SamplingParams
from launch import LLM, BeamSearchParams
from launch.admission import Admission
from models.tiny import TINY_VOCAB
from tests.conftest import hf_greedy, make_prompts

MAX_NEW = 6


def test_prompt_dicts_give_transformers_tokens_and_vllms_output_fields(tiny_checkpoint):
    from transformers import AutoTokenizer
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    a, b, c, salted = make_prompts(4, TINY_VOCAB, 9, 40, seed=61)
    text = tok.decode(make_prompts(1, TINY_VOCAB, 12, 12, seed=62)[0], skip_special_tokens=True)
    text_ids = tok.encode(text)
    expected = hf_greedy(path, [a, text_ids, b, c, salted], MAX_NEW)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(path, attention_ranks=1, expert_ranks=1, block_size=8) as llm:
        outs = llm.generate([{"prompt_token_ids": a}, {"prompt": text}, {"prompt_token_ids": b, "prompt": "label"},
                             c], params)
        single = llm.generate({"prompt_token_ids": a}, params)
        # the salt of a prompt dict keys the prefix cache: found again under "x" only
        cached = [llm.generate({"prompt_token_ids": salted, **({} if s is None else {"cache_salt": s})},
                               params)[0] for s in ("x", "x", "y", None)]
        with pytest.raises(ValueError, match=r"prompts\[1\]: prompt dict's 'cache_salt' '' is invalid"):
            llm.generate([text, {"prompt": text, "cache_salt": ""}], params)
        # beam search sends its steps under a prompt dict's salt: the prompt is then found cached under it
        beams = llm.beam_search([{"prompt_token_ids": b, "cache_salt": "z"}, b], BeamSearchParams(2, 3))
        salted_b = llm.generate({"prompt_token_ids": b, "cache_salt": "z"}, params)[0]
    assert [o.outputs[0].token_ids for o in outs] == expected[:4]
    assert [o.prompt for o in outs] == [None, text, "label", None]
    assert [o.prompt_token_ids for o in outs] == [a, text_ids, b, c]
    for o in outs:
        assert o.finished and o.outputs[0].finished() and o.outputs[0].index == 0
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert o.outputs[0].finish_reason == "length"
    assert len(single) == 1 and single[0].outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in cached] == [expected[4]] * 4
    hits = [o.num_cached_tokens for o in cached]
    assert hits[0] == hits[2] == hits[3] == 0 < hits[1], hits
    # a salted prompt dict searches as its plain ids do, and its steps cached b's blocks under the salt
    assert [s.tokens for s in beams[0].sequences] == [s.tokens for s in beams[1].sequences]
    assert salted_b.num_cached_tokens == (len(b) - 1) // 8 * 8 > 0


def test_prompt_dict_keys_not_served_are_refused_by_name():
    adm = Admission(None, TINY_VOCAB, 4, 64, 64)
    assert adm.prompt_input({"prompt_token_ids": (5, 6), "cache_salt": "s"}).cache_salt == "s"
    assert adm.prompt_input({"prompt_token_ids": [5, 6]}).ids == [5, 6]
    # vLLM's options for inputs not served here are taken when unset, as vLLM acts only on set ones
    assert adm.prompt_input({"prompt_token_ids": [5], "multi_modal_data": None, "mm_processor_kwargs": {}}).ids == [5]
    for bad, why in (({"prompt_token_ids": [5], "multi_modal_data": {"image": 1}}, "'multi_modal_data' is set, and"),
                     ({"prompt_embeds": None}, "key 'prompt_embeds' is unknown or not served: pass prompt, "),
                     ({"prompt_ids": [5]}, "key 'prompt_ids' is unknown"),
                     ({}, "needs 'prompt' .* or 'prompt_token_ids'"),
                     ({"prompt_token_ids": "5 6"}, "'prompt_token_ids' '5 6' is not a list"),
                     ({"prompt_token_ids": [5, TINY_VOCAB]}, f"token id {TINY_VOCAB} is outside"),
                     ({"prompt": 5}, "'prompt' 5 is not a string"),
                     ({"prompt_token_ids": [5], "cache_salt": 7}, "'cache_salt' 7 is invalid"),
                     ({"prompt": "text"}, "has no tokenizer")):
        with pytest.raises(ValueError, match=why):
            adm.prompt_input(bad)
