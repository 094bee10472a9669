"""The shipped trained model (models/shakespeare-moe): token-identical greedy text and teacher-forced logits
against transformers on 1+2 and 2+2 ranks, and held-out perplexity through `LLM` equal to transformers'."""
from __future__ import annotations

import math
import os

import pytest
import torch

from launch import LLM, SamplingParams
from models import SHIPPED_MODEL
from tests.conftest import hf_greedy, hf_model, wider
from tests.dist_utils import run_ranks
from tests.launch.test_teacher_forced import _rank_fn

pytestmark = pytest.mark.skipif(not os.path.isdir(SHIPPED_MODEL), reason="models/shakespeare-moe is not built")

PROMPTS = ["ROMEO.\n", "Juliet.\nO Romeo, Romeo! wherefore art thou Romeo?\n", "Hamlet.\nTo be, or not to be,",
           "KING.\nWhat news from France?\n\nMESSENGER.\n", "Enter"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(SHIPPED_MODEL)


def _held_out_ids(tokenizer, num_chars: int) -> tuple[list[int], int]:
    """<s> + the first lines (up to num_chars) of the held-out play, and how many characters they are."""
    with open(os.path.join(SHIPPED_MODEL, "heldout.txt")) as f:
        text = f.read()
    text = text[:text.rindex("\n", 0, num_chars) + 1]
    return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]], len(text)


def test_shipped_folder_is_what_the_issue_asks(tokenizer):
    from transformers import AutoConfig
    files = os.listdir(SHIPPED_MODEL)
    total = sum(os.path.getsize(os.path.join(SHIPPED_MODEL, f)) for f in files)
    assert total <= 12 * 10**6, f"{total} bytes"
    assert {"config.json", "model.safetensors", "tokenizer.json", "heldout.txt", "training.json"} <= set(files)
    cfg = AutoConfig.from_pretrained(SHIPPED_MODEL)
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts >= 8 and cfg.num_experts_per_tok == 2
    assert 1000 <= len(tokenizer) <= 8000
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Speak."}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat.endswith("<s>assistant\n") and "Speak." in chat


@pytest.mark.parametrize("attention_ranks,expert_ranks", [wider(1, 2), (2, 2)])
def test_greedy_text_matches_transformers(tokenizer, attention_ranks, expert_ranks):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    expected = hf_greedy(SHIPPED_MODEL, prompts, MAX_NEW)
    with LLM(SHIPPED_MODEL, attention_ranks=attention_ranks, expert_ranks=expert_ranks) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    # A trained model writes words: most of what it says is letters and spaces, over several distinct words.
    text = "".join(o.text for o in outs)
    assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.85, text
    assert len(set(text.split())) >= 20, text


@pytest.mark.parametrize("attention_ranks,expert_ranks", [wider(1, 2), (2, 2)])
def test_teacher_forced_logits_match_transformers(tokenizer, attention_ranks, expert_ranks):
    prompt, _ = _held_out_ids(tokenizer, 400)
    with torch.no_grad():
        expected = hf_model(SHIPPED_MODEL)(torch.tensor([prompt])).logits[0]
    results = run_ranks(_rank_fn, attention_ranks + expert_ranks, SHIPPED_MODEL, attention_ranks, prompt)
    torch.testing.assert_close(results[0]["logits"], expected, atol=1e-4, rtol=1e-5)


def test_held_out_perplexity_through_llm_matches_transformers(tokenizer):
    """Bits per character of a held-out passage, from the prompt logprobs of `LLM` (chunked prefill over 2
    attention ranks) and from transformers' forward, agree to 1e-4 relative."""
    ids, num_chars = _held_out_ids(tokenizer, 2000)  # about 850 tokens: within max_model_len 1024
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(SHIPPED_MODEL)(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
    want = -logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item() / (math.log(2) * num_chars)
    with LLM(SHIPPED_MODEL, attention_ranks=2, expert_ranks=2, max_num_batched_tokens=256) as llm:
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    got = -sum(entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:])) / (math.log(2) * num_chars)
    assert got == pytest.approx(want, rel=1e-4)
    assert 1.0 < got < 3.0  # a trained model; a random one scores about log2(vocab) / chars-per-token ~ 4 bits
