"""The CUDA path on a real GPU (skipped without one; scripts/gpu_check.sh runs these on a lent GPU): every
architecture's greedy tokens equal transformers' with all ranks sharing one GPU through the cuda_ipc
transport, bf16 prompt log-probabilities near transformers' bf16 ones, and a seeded request drawn on the
device twice gives the same text."""
from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams
from models.tiny import ARCHS
from tests.conftest import hf_greedy, hf_model, make_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW = 8
BF16_LOGPROB_TOL = 0.15     # nats: the largest |ours - transformers'| over a prompt's tokens, both in bf16
KV = 64 << 20               # KV bytes per attention rank: several engines may share the GPU (pytest -n)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("A,E", [(1, 1), (1, 3)])
def test_greedy_on_one_gpu_through_cuda_ipc(tiny_checkpoint, arch, A, E):
    """fp32 on the GPU against transformers in fp32 on the CPU; every rank on GPU 0, which NCCL would refuse; two
    ping-pong micro-batches (asked for: auto runs one where ranks share a GPU)."""
    path = tiny_checkpoint(arch)
    prompts = make_prompts(4, 256, 3, 30, seed=21)
    expected = hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, attention_ranks=A, expert_ranks=E, device="cuda", dtype="float32", transport="cuda_ipc",
             max_num_batched_tokens=48, kv_cache_memory=KV, micro_batches=2) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_bf16_prompt_logprobs_near_transformers_bf16(tiny_checkpoint, arch):
    """Teacher-forced: the log-probability of each prompt token given the ones before, ours (bf16, Triton
    kernels) against transformers' bf16 model on the same GPU."""
    path = tiny_checkpoint(arch)
    prompt = make_prompts(1, 256, 40, 40, seed=3)[0]
    model = hf_model(path).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0].float(), -1)
    want = [float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    with LLM(path, attention_ranks=1, expert_ranks=1, device="cuda", dtype="bfloat16",
             kv_cache_memory=KV) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
    worst = max(abs(g - w) for g, w in zip(got, want))
    print(f"{arch}: bf16 prompt logprobs, largest difference {worst:.4f} nats")
    assert worst < BF16_LOGPROB_TOL


def test_seeded_request_twice_gives_the_same_text(tiny_checkpoint):
    """Per-request generators live on the GPU (a CPU generator cannot draw into CUDA probabilities)."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(3, 256, 5, 20, seed=4)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    with LLM(path, attention_ranks=1, expert_ranks=1, device="cuda", kv_cache_memory=KV) as llm:
        first = [o.token_ids for o in llm.generate(prompts, params)]
        second = [o.token_ids for o in llm.generate(prompts, params)]
        other = [o.token_ids for o in llm.generate(prompts, SamplingParams(
            max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))]
    assert first == second
    assert other != first
