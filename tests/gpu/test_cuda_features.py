"""Features built since the last GPU run, on a real GPU (skipped without one; scripts/gpu_check.sh runs these on a
lent GPU), every rank on GPU 0 through cuda_ipc: PD with streamed KV, n-gram speculative decoding, the sync audit of
a decode step with in-band row counts (on by default with cuda_ipc), structured outputs, and a float8 KV cache."""
from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams
from tests.conftest import hf_greedy, make_prompts
from tests.launch.test_host_syncs import host_read_sites

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW = 10
KV = 64 << 20
GPU = dict(device="cuda", dtype="float32", transport="cuda_ipc", kv_cache_memory=KV)


def test_pd_with_streamed_kv_on_one_gpu(tiny_checkpoint):
    """1 prefill + 1 decode rank + 1 expert rank: prompts of 40-60 tokens through a 12-token budget stream their
    full blocks to the decode rank while they prefill; the tokens are transformers'."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(3, 256, 40, 60, seed=11)
    with LLM(path, attention_ranks=2, expert_ranks=1, prefill_ranks=1, block_size=4, max_num_batched_tokens=12,
             enable_prefix_caching=True, **GPU) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        pd = llm.stats()["pd"]
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, MAX_NEW)
    assert pd["kv_blocks_streamed"] > 0 and pd["requests_transferred"] == len(prompts)
    print(f"PD on the GPU: {pd['kv_blocks_streamed']} blocks streamed, {pd['kv_blocks_transferred']} at the moves")


def test_ngram_speculation_on_one_gpu(tiny_checkpoint):
    """Prompts that repeat themselves, so the n-gram proposer drafts; greedy verification keeps transformers'
    tokens."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = [(p * 4)[:40] for p in make_prompts(3, 256, 6, 9, seed=2)]
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(path, attention_ranks=1, expert_ranks=2, speculative_config=config, **GPU) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        drafted = llm.stats()["spec_decode"]["num_draft_tokens"]
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, MAX_NEW)
    assert drafted > 0


def test_a_decode_step_reads_back_only_the_sampled_ids_on_one_gpu(tiny_checkpoint):
    """cuda_ipc with two expert ranks (row counts in-band by default on CUDA) and a replica to choose between:
    the audit counts one host read per decode step on the attention rank (the sampled ids) and none on the
    expert ranks, as on CPU."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(4, 256, 5, 20, seed=9)
    with LLM(path, attention_ranks=1, expert_ranks=2, sync_audit=True, balancer="least_loaded",
             redundant_experts=1, **GPU) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        ranks = llm.comm_stats()["ranks"]
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, MAX_NEW)
    (site,) = host_read_sites()
    attention = ranks["0"]["host_syncs"]
    print(f"host syncs per decode step on the GPU: {[r['host_syncs'] for r in ranks.values()]}")
    assert attention["decode_steps"] >= 1
    assert attention["max_per_decode_step"] == 1 and set(attention["sites"]) == {site}, attention
    for r in ("1", "2"):
        assert ranks[r]["host_syncs"]["max_per_decode_step"] == 0, ranks[r]["host_syncs"]


def test_structured_outputs_on_one_gpu(tiny_checkpoint):
    """xgrammar's mask on CUDA logits (its bitmask copied to the device): greedy outputs equal transformers'
    greedy generate under the test's own matcher, as on the CPU (tests/launch/test_structured_outputs.py)."""
    from transformers import AutoTokenizer

    from tests.conftest import hf_model
    from tests.launch.test_structured_outputs import CASES, MAX_NEW as STRUCTURED_NEW, _hf_constrained
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(len(CASES), 256, 4, 12, seed=32)
    with LLM(path, attention_ranks=1, expert_ranks=1, **GPU) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=STRUCTURED_NEW, structured_outputs=spec)
                                      for spec, _ in CASES])
    tok, model = AutoTokenizer.from_pretrained(path), hf_model(path)
    for prompt, (spec, compile_fn), out in zip(prompts, CASES, outs):
        assert out.token_ids == _hf_constrained(model, tok, prompt, compile_fn, STRUCTURED_NEW), spec


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_on_one_gpu(tiny_checkpoint, kv_cache_dtype):
    """A float8 KV cache read by the Triton kernels natively: greedy tokens equal transformers' (on the CPU) with
    its cache rounded through the same float8 format, and prompt logprobs close to it, as on the CPU
    (tests/launch/test_fp8_kv_cache.py, where the tolerances are explained)."""
    from tests.launch.test_fp8_kv_cache import FORMATS, hf_runs
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(4, 256, 8, 40, seed=21)
    want_tokens, want_lps = hf_runs(path, prompts, FORMATS[kv_cache_dtype])
    with LLM(path, attention_ranks=1, expert_ranks=1, kv_cache_dtype=kv_cache_dtype, **GPU) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, prompt_logprobs=0))
    assert [o.token_ids for o in outs] == want_tokens
    got = torch.tensor([e[t] for o, p in zip(outs, prompts) for e, t in zip(o.prompt_logprobs[1:], p[1:])])
    off = (got - torch.tensor([x for row in want_lps for x in row])).abs()
    print(f"{kv_cache_dtype} on the GPU: prompt logprobs within {float(off.max()):.2e} of the rounded model's")
    assert float(off.max()) <= 5e-3 and float((off <= 1e-4).float().mean()) >= 0.85
