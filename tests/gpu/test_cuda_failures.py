"""Membership changes on the GPU (skipped without one), every rank on one GPU through cuda_ipc: an expert rank
SIGKILLed while requests stream is detected like a dead shm peer (its pid, host flags), the survivors re-form,
move expert weights between them (through host memory: their groups are gloo) and every output is still
transformers' greedy continuation; the CPU scale test (grow, then shrink with a KV handover) on CUDA."""
from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams
from tests.conftest import hf_greedy, make_prompts
from tests.dist_utils import alive
from tests.launch.runtime.test_elastic import _stream, scale_under_stream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW = 24
KV = 64 << 20


def test_expert_rank_killed_mid_generation_on_one_gpu(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(6, 256, 5, 30, seed=3)
    expected = hf_greedy(path, prompts, MAX_NEW)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(path, attention_ranks=1, expert_ranks=3, device="cuda", dtype="float32", transport="cuda_ipc",
             kv_cache_memory=KV) as llm:
        pids = llm.worker_pids
        assert _stream(llm, prompts, params, pids[2], after_tokens=12) == expected
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected     # the re-formed job again
        change, = llm.stats()["membership_changes"]
    assert not alive(pids[2])
    assert change["lost"] == [2] and (change["attention_ranks"], change["expert_ranks"]) == (1, 2)
    print(f"re-formed on the GPU: detect {change['detect_s']:.2f}s, groups {change['groups_s']:.2f}s, "
          f"weights {change['weights_s']:.2f}s")


def test_scale_out_and_in_under_a_steady_stream_on_one_gpu(tiny_checkpoint):
    scale_under_stream(tiny_checkpoint("qwen3_moe"), device="cuda", dtype="float32", transport="cuda_ipc",
                       kv_cache_memory=KV)
