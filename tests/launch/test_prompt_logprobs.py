"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' teacher-forced log-softmax, through
chunked prefill, preemption and several attention ranks, without changing any request's tokens."""
from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams
from tests.conftest import hf_greedy, hf_model, make_prompts

MAX_NEW = 6


def _hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row p is the log-distribution of token p + 1 given tokens 0..p."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("attention_ranks,expert_ranks", [(1, 2), (2, 2)])
def test_prompt_logprobs_match_transformers(tiny_checkpoint, attention_ranks, expert_ranks):
    path = tiny_checkpoint("qwen3_moe")
    # 70 and 45 tokens are longer than the 32-token budget, so their logprobs come from several chunks.
    prompts = [make_prompts(1, 256, 70, 70, seed=11)[0], make_prompts(1, 256, 45, 45, seed=12)[0],
               *make_prompts(4, 256, 2, 20, seed=13)]
    k = [3, 0, 1, None, 5, None]
    params = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=kk) for kk in k]
    with LLM(path, attention_ranks=attention_ranks, expert_ranks=expert_ranks, max_num_batched_tokens=32,
             num_kv_blocks=12, max_num_seqs=6) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
    assert stats["num_prefill_chunks"] > 0
    if attention_ranks == 1:
        assert stats["num_preemptions"] > 0  # recomputed prompts must not be scored twice
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, MAX_NEW)
    for prompt, kk, out in zip(prompts, k, outs):
        if kk is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        want = _hf_prompt_logprobs(path, prompt)
        for p, entry in enumerate(out.prompt_logprobs[1:]):
            tok = prompt[p + 1]
            assert entry[tok] == pytest.approx(want[p, tok].item(), abs=1e-4)
            top = want[p].topk(kk)
            assert set(entry) == set(top.indices.tolist()) | {tok}
            for t, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[t] == pytest.approx(lp, abs=1e-4)


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_prompt_logprobs_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=rf"prompt_logprobs={bad!r}.*\[0, 20\]"):
        SamplingParams(prompt_logprobs=bad)
