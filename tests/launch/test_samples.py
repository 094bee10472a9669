"""n > 1 and best_of through the whole engine: forked samples share the prompt's blocks and copy the shared,
partly filled one before writing (greedy samples are transformers' tokens, which fails if the copy is skipped),
seeded sampling repeats, and best_of returns the samples with the highest summed logprob."""
from __future__ import annotations

from conftest import hf_greedy, make_prompts

from launch.llm import LLM, SamplingParams


def test_samples_share_the_prompt_and_repeat_with_a_seed(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    a, b = make_prompts(2, 256, 10, 21, seed=61)           # neither a multiple of the block size (4)
    expected = hf_greedy(path, [a, b], 6)
    sampled = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, n=3, seed=7, logprobs=0)
    with LLM(path, attention_ranks=1, expert_ranks=2, block_size=4) as llm:
        greedy = llm.generate([a, b], SamplingParams(max_tokens=6, ignore_eos=True, n=3))
        first, again = llm.generate([a], sampled)[0], llm.generate([a], sampled)[0]
        best = llm.generate([a], SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, n=1, best_of=3,
                                                seed=7))[0]
        stats = llm.stats()
    for out, want in zip(greedy, expected):
        assert [s.token_ids for s in out.samples] == [want] * 3 and [s.index for s in out.samples] == [0, 1, 2]
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in again.samples]
    assert len({tuple(s.token_ids) for s in first.samples}) > 1           # the samples differ from each other
    top = max(first.samples, key=lambda s: s.cumulative_logprob)
    assert [s.token_ids for s in best.samples] == [top.token_ids] and best.logprobs is None
    assert best.samples[0].cumulative_logprob == top.cumulative_logprob
    assert stats["num_running"] == 0 and stats["free_kv_blocks"] == stats["kv_blocks"]
