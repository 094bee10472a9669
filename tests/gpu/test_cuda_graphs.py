"""Decode graphs on a real GPU (skipped without one; scripts/gpu_check.sh runs these): with the default options the
attention rank captures CUDA graphs for its decode micro-batches and replays them, every architecture's greedy
tokens equal transformers' (fp32), requests finishing at different steps move the micro-batches through several
buckets, and enforce_eager=True captures nothing and gives the same tokens."""
from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams
from models.tiny import ARCHS
from tests.conftest import hf_greedy, make_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KV = 64 << 20


def generate(path: str, prompts: list[list[int]], max_new: list[int], A: int = 1, E: int = 1, ranks=None,
             **options):
    """Greedy tokens, each attention rank's graph stats (ranks: a list that gets every rank's comm stats)."""
    with LLM(path, attention_ranks=A, expert_ranks=E, device="cuda", dtype="float32", transport="cuda_ipc",
             max_num_batched_tokens=64, kv_cache_memory=KV, micro_batches=2, micro_batch_min_tokens=1, max_num_seqs=16,
             **options) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_new])
        stats = llm.comm_stats()["ranks"]
    if ranks is not None:
        ranks.append(stats)
    return [o.token_ids for o in outs], [stats[str(r)]["graphs"] for r in range(A)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("A,E", [(1, 1), (1, 3)])
def test_graphs_give_transformers_tokens(tiny_checkpoint, arch, A, E):
    path = tiny_checkpoint(arch)
    prompts = make_prompts(12, 256, 3, 30, seed=31)
    max_new = [4 + (i % 5) * 2 for i in range(12)]      # 12 rows shrinking to 3: several buckets per slot
    tokens, graphs = generate(path, prompts, max_new, A, E)
    expected = hf_greedy(path, prompts, max(max_new))
    assert tokens == [e[:n] for e, n in zip(expected, max_new)]
    for g in graphs:
        assert g["failed"] is None, g
        assert g["replays"] > 0 and {j for j, _ in g["captured"]} == {0, 1}, g    # both micro-batch slots


def test_enforce_eager_captures_nothing_and_gives_the_same_tokens(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(8, 256, 3, 30, seed=32)
    max_new = [6] * 8
    graphed, g = generate(path, prompts, max_new)
    eager, e = generate(path, prompts, max_new, enforce_eager=True)
    assert graphed == eager
    assert g[0]["replays"] > 0 and e == [None]


def test_a_graphed_decode_step_reads_the_host_once(tiny_checkpoint):
    """The sync audit on the GPU with graphs on: a decode step's one host read is the sampled ids (replays are not
    aten ops, so the audit sees only the copies around them and the exchange)."""
    path = tiny_checkpoint("qwen3_moe")
    ranks: list = []
    _, (g,) = generate(path, make_prompts(6, 256, 3, 20, seed=33), [6] * 6, ranks=ranks, sync_audit=True)
    audit = ranks[0]["0"]["host_syncs"]
    assert g["replays"] > 0 and audit["decode_steps"] > 0
    assert audit["max_per_decode_step"] == 1, audit
