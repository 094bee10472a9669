"""Request admission (launch/admission.py) and the front's prompt-side options: add_special_tokens reaches the
tokenizer for completion prompts and chats, and truncate_prompt_tokens keeps a string's BOS (a tokenizer that adds
one shows it); bad words become token ids by vLLM's rule; ids outside the vocabulary, or allowed ids that leave
nothing to sample, are refused by field; LLM.generate without params takes the checkpoint's defaults."""
from __future__ import annotations

import pytest
from tokenizers import processors

from attention_nodes.sampling_params import SamplingParams
from launch.admission import Admission
from launch.frontend.chat import ChatCompletionRequest
from launch.frontend.protocol import APIError
from launch.frontend.tokens import bad_words_ids, chat_ids
from models.tiny import TINY_VOCAB, save_tiny_tokenizer


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    """The tiny tokenizer, made to put <s> before every encoded text unless add_special_tokens is False."""
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                  special_tokens=[("<s>", tok.bos_token_id)])
    return tok


def admission(tok, **limits) -> Admission:
    return Admission(tok, TINY_VOCAB, **{"max_num_seqs": 4, "max_model_len": 64, "kv_capacity_tokens": 64, **limits})


def test_add_special_tokens_reaches_the_tokenizer(bos_tokenizer):
    tok = bos_tokenizer
    bos, text = tok.bos_token_id, "Hello experts"
    plain = tok.encode(text, add_special_tokens=False)
    adm = admission(tok)
    assert adm.prompt_ids(text) == [bos] + plain                     # completions' default (vLLM's)
    assert adm.prompt_ids(text, add_special_tokens=False) == plain
    assert adm.prompt_ids([7, 8], add_special_tokens=True) == [7, 8]   # ids are taken as they are
    # truncate_prompt_tokens: cut on the left; a string keeps its BOS (vLLM's truncation="left" of the text)
    assert adm.prompt_ids(text, truncate=3) == [bos] + plain[-2:]
    assert adm.prompt_ids(text, add_special_tokens=False, truncate=3) == plain[-3:]
    assert adm.prompt_ids([7, 8, 9, 10], truncate=3) == [8, 9, 10]
    assert adm.prompt_ids(text, truncate=100) == [bos] + plain and tok.truncation_side == "right"
    messages = [{"role": "user", "content": text}]
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    body = ChatCompletionRequest(messages=messages)
    assert body.add_special_tokens is False                           # chat's default (vLLM's)
    assert chat_ids(tok, body, "tiny") == tok.encode(templated, add_special_tokens=False)
    assert chat_ids(tok, body, "tiny", add_special_tokens=True) == [bos] + tok.encode(templated,
                                                                                      add_special_tokens=False)


def test_bad_words_become_ids_by_vllms_rule(bos_tokenizer):
    tok = bos_tokenizer

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    candidates = "Mixture experts route each token to a few Attention ranks hold the paged KV cache quick fox".split()
    # a word whose spaced form is another sequence of the same length: both are banned (leading spaces stripped)
    same = next(w for w in candidates if len(ids(w)) == len(ids(" " + w)) and ids(w)[0] != ids(" " + w)[0])
    assert bad_words_ids(tok, ["  " + same]) == [ids(same), ids(" " + same)]
    # a word whose spaced form has another length: only the word alone (vLLM's rule)
    other = next(w for w in candidates if len(ids(w)) != len(ids(" " + w)))
    assert bad_words_ids(tok, [other, same]) == [ids(other), ids(same), ids(" " + same)]
    assert bad_words_ids(tok, None) == [] and bad_words_ids(None, []) == []
    for tok_, words, words_in_error in ((tok, ["ok", " "], "empty word"), (None, ["x"], "has none")):
        with pytest.raises(APIError, match=words_in_error) as err:
            bad_words_ids(tok_, words)
        assert err.value.param == "bad_words"


def test_token_ids_that_cannot_be_served_are_refused_by_field():
    adm = admission(None)
    for field, value, bad in (("allowed_token_ids", [3, TINY_VOCAB], TINY_VOCAB),
                              ("bad_words_token_ids", [[4], [5, TINY_VOCAB + 2]], TINY_VOCAB + 2)):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} has token id {bad}\b"):
            adm.check([1, 2], SamplingParams(**{field: value}))
    adm.check([1, 2], SamplingParams(allowed_token_ids=[TINY_VOCAB - 1], bad_words_token_ids=[[0, 1]]))
    # allowed ids that leave nothing to sample (every logit would be -inf): refused
    adm = Admission(None, TINY_VOCAB, 4, 64, 64, eos_token_ids=(2,))
    for params in (SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[5], [6], [7, 8]]),
                   SamplingParams(allowed_token_ids=[2, 9], stop_token_ids=[9], min_tokens=1)):
        with pytest.raises(ValueError, match=r"allowed_token_ids \(2 ids\) leaves nothing to sample"):
            adm.check([1], params)
    for params in (SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[5], [7, 6]]),
                   SamplingParams(allowed_token_ids=[2, 9], stop_token_ids=[9], min_tokens=1, ignore_eos=True),
                   SamplingParams(allowed_token_ids=[2, 9], stop_token_ids=[9])):
        adm.check([1], params)
    with pytest.raises(ValueError, match="max_model_len=64"):
        adm.check(list(range(60)), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        adm.check([1], SamplingParams(n=5))


def test_generate_without_params_takes_the_checkpoints_defaults(tiny_checkpoint, tmp_path):
    """As vLLM's LLM.generate: without SamplingParams, the checkpoint's generation_config.json gives the defaults
    (here repetition_penalty 1.3 on greedy): the tokens equal transformers' generate, which reads the same file;
    SamplingParams given are taken as they are (no penalty: transformers' with the penalty turned off)."""
    import shutil

    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from launch import LLM
    from tests.conftest import hf_model, make_prompts

    path = str(tmp_path / "penalized")
    shutil.copytree(tiny_checkpoint("qwen3_moe"), path)
    config = GenerationConfig.from_pretrained(path)
    config.repetition_penalty = 1.3
    config.save_pretrained(path)
    prompt = make_prompts(1, 256, 12, 12, seed=31)[0]
    model = hf_model(path)
    with torch.no_grad():
        def ref(**kw):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0, **kw)
            return out[0, len(prompt):].tolist()
        penalized, plain = ref(), ref(repetition_penalty=1.0)
    assert penalized != plain
    with LLM(path, attention_ranks=1, expert_ranks=1) as llm:
        default, given = llm.generate([prompt, prompt]), llm.generate([prompt], SamplingParams(max_tokens=16))
        shown, tok = llm.get_default_sampling_params(), llm.get_tokenizer()    # vLLM's accessors
    assert [o.token_ids for o in default] == [penalized, penalized]
    assert given[0].token_ids == plain
    assert shown.repetition_penalty == 1.3 and shown == SamplingParams(repetition_penalty=1.3)
    assert tok("to be").input_ids == AutoTokenizer.from_pretrained(path)("to be").input_ids
    # generation_config="vllm" (vLLM's flag value): the checkpoint's defaults are not read
    with LLM(path, attention_ranks=1, expert_ranks=1, generation_config="vllm") as llm:
        assert llm.generate([prompt])[0].token_ids == plain
        assert llm.get_default_sampling_params() == SamplingParams()


def test_generation_config_directory_gives_the_eos_ids_too(tiny_checkpoint, tmp_path):
    """--generation-config DIR: DIR's eos_token_id ends outputs (vLLM reads EOS ids from where its flag points), and
    the checkpoint's EOS does not; oracle: transformers' greedy tokens, cut after the first DIR EOS."""
    from transformers import GenerationConfig

    from launch import LLM
    from tests.conftest import hf_greedy, make_prompts

    path = tiny_checkpoint("qwen3_moe")
    prompt = make_prompts(1, 256, 10, 10, seed=5)[0]
    want = hf_greedy(path, [prompt], 16)[0]
    eos = want[5]                        # a token greedy draws at position 5 (or earlier)
    GenerationConfig(eos_token_id=[eos]).save_pretrained(tmp_path)
    with LLM(path, attention_ranks=1, expert_ranks=1, generation_config=str(tmp_path)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    assert out.token_ids == want[:want.index(eos) + 1] and out.finish_reason == "stop"


def test_generation_config_option_names_where_the_defaults_come_from(tmp_path):
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from launch.admission import sampling_defaults
    from launch.config import EngineConfig
    from models import SHIPPED_MODEL

    GenerationConfig(do_sample=True, top_k=7, temperature=0.5).save_pretrained(tmp_path)
    config = SimpleNamespace(model=SHIPPED_MODEL, generation_config=str(tmp_path))
    assert dict(sampling_defaults(config)) == {"top_k": 7, "temperature": 0.5}
    config.generation_config = "vllm"
    assert sampling_defaults(config) == ()
    for bad in ("vLLM", str(tmp_path / "nowhere"), 3):
        with pytest.raises(ValueError, match=r"generation_config=.* is invalid: pass auto, vllm or a directory"):
            EngineConfig.from_options(SHIPPED_MODEL, 1, 1, generation_config=bad)
