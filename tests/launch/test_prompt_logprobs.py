"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' teacher-forced log-softmax, and each prompt
token's rank its rank there, through chunked prefill, preemption and several attention ranks, without changing any
request's tokens."""
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
            assert out.prompt_logprobs is None and out.prompt_logprob_ranks is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprob_ranks) == len(prompt) and out.prompt_logprob_ranks[0] is None
        want = _hf_prompt_logprobs(path, prompt)
        for p, (entry, rank) in enumerate(zip(out.prompt_logprobs[1:], out.prompt_logprob_ranks[1:])):
            tok = prompt[p + 1]
            assert entry[tok] == pytest.approx(want[p, tok].item(), abs=1e-4)
            assert _rank_bounds(want[p], tok)[0] <= rank <= _rank_bounds(want[p], tok)[1], (p, rank)
            top = want[p].topk(kk)
            assert set(entry) == set(top.indices.tolist()) | {tok}
            for t, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[t] == pytest.approx(lp, abs=1e-4)


def _rank_bounds(row: torch.Tensor, tok: int, tol: float = 1e-4) -> tuple[int, int]:
    """The ranks (1 = most likely) token tok may have in the engine, given transformers' log-distribution row:
    counting the tokens surely more likely, and those at least as likely within tol."""
    x = row[tok].item()
    return int((row > x + tol).sum()) + 1, int((row >= x - tol).sum())


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_prompt_logprobs_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=rf"prompt_logprobs={bad!r}.*\[0, 20\]"):
        SamplingParams(prompt_logprobs=bad)


def test_generated_logprobs_prompt_scoring_and_logit_shaping_match_transformers(tiny_checkpoint):
    """One engine (1+2 ranks): (a) each generated token's logprob and top-3 equal transformers' log-softmax over the
    prompt plus the tokens before it; (b) max_tokens=0 with prompt_logprobs scores the prompt and generates
    nothing; (c) greedy with repetition_penalty=1.3 equals transformers' generate with it, (d) a -100
    logit_bias on greedy's first choice equals transformers' with the same sequence_bias, (e) allowed_token_ids
    equals transformers' with prefix_allowed_tokens_fn giving the same set, and (f) bad_words_token_ids (one
    token, and greedy's 2nd and 3rd tokens as one word) equal transformers' bad_words_ids (each changes the
    tokens: the test fails if the engine ignores it), and (g) a seeded draw at temperature 1 with min_p 1 is
    greedy (without min_p the same seed draws other tokens). A token id outside the vocabulary in
    allowed_token_ids is a ValueError naming it."""
    path = tiny_checkpoint("qwen3_moe")
    a, b, c = make_prompts(3, 256, 8, 20, seed=26)
    free = hf_greedy(path, [c], MAX_NEW)[0]
    banned = free[0]
    allowed = sorted(set(range(3, 256, 5)) - {banned})
    bad_words = [[free[3]], [free[1], free[2]]]
    assert c[-1] != free[1]     # transformers also matches a word's start against the prompt; the engine does not
    with LLM(path, attention_ranks=1, expert_ranks=2) as llm:
        scored, none, penalized, biased, only, clean, drawn, top = llm.generate([a, b, c, c, c, c, c, c], [
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
            SamplingParams(max_tokens=0, prompt_logprobs=2),
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logit_bias={banned: -100}),
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, allowed_token_ids=allowed),
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, bad_words_token_ids=bad_words),
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=1.0, seed=3),
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=1.0, seed=3, min_p=1.0)])
        with pytest.raises(ValueError, match=r"allowed_token_ids has token id 999999"):
            llm.generate([c], SamplingParams(allowed_token_ids=[5, 999999]))
    # (a)
    assert scored.token_ids == hf_greedy(path, [a], MAX_NEW)[0] and len(scored.logprobs) == MAX_NEW
    want = _hf_prompt_logprobs(path, a + scored.token_ids)
    for i, (tok, entry) in enumerate(zip(scored.token_ids, scored.logprobs)):
        row = want[len(a) - 1 + i]
        assert entry[tok] == pytest.approx(row[tok].item(), abs=1e-4)
        assert set(entry) == set(row.topk(3).indices.tolist()) | {tok}
    # (b)
    assert none.token_ids == [] and none.finish_reason == "length" and none.logprobs is None
    assert len(none.prompt_logprobs) == len(b) and none.prompt_logprobs[0] is None
    want_b = _hf_prompt_logprobs(path, b)
    assert all(e[b[p + 1]] == pytest.approx(want_b[p, b[p + 1]].item(), abs=1e-4)
               for p, e in enumerate(none.prompt_logprobs[1:]))
    # (c), (d)
    model = hf_model(path)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        def ref(**kw):
            return model.generate(torch.tensor([c]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                                  **kw)[0, len(c):].tolist()
        want_pen, want_bias = ref(repetition_penalty=1.3), ref(sequence_bias={(banned,): -100.0})
        want_only = ref(prefix_allowed_tokens_fn=lambda batch, ids: allowed)
        want_clean = ref(bad_words_ids=bad_words)
    assert penalized.token_ids == want_pen != free
    assert biased.token_ids == want_bias != free and banned not in want_bias
    assert only.token_ids == want_only != free and set(want_only) <= set(allowed)
    assert clean.token_ids == want_clean != free and free[3] not in want_clean
    assert top.token_ids == free != drawn.token_ids
