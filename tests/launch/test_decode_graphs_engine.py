"""Decode graphs in the whole runtime, on the CPU through the RecordedGraph stand-in (AFSERVE_GRAPH_EMULATION=1,
which the spawned ranks inherit; kernel_backend torch): the attention ranks replay captured graphs for their decode
micro-batches and the greedy tokens stay transformers', in every architecture and in the topologies, comm modes and
balancers that change what a decode step sends. enforce_eager=True turns them off."""
from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from models.tiny import ARCHS
from tests.conftest import hf_greedy, make_prompts, wider

MAX_NEW = 6


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setenv("AFSERVE_GRAPH_EMULATION", "1")


def graph_stats(comm: dict, attention_ranks: int) -> list[dict]:
    return [comm["ranks"][str(r)]["graphs"] for r in range(attention_ranks)]


def run(path: str, prompts: list[list[int]], **options) -> tuple[list[list[int]], dict]:
    with LLM(path, kernel_backend="torch", **options) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        return [o.token_ids for o in outs], llm.comm_stats()


@pytest.mark.parametrize("arch", [a if a in ("qwen3_moe", "deepseek_v3", "gpt_oss") else wider(a) for a in ARCHS])
def test_graphs_give_transformers_tokens(tiny_checkpoint, emulated, arch):
    """Five prompts of mixed lengths (decode rows shrink as the shorter finish... they all run MAX_NEW; the micro-
    batches split 3 and 2, then every row decodes): with 2 micro-batches each replays its own slot's graphs, and
    with max_num_seqs 5 the second slot's buckets (up to slot_rows' 3 rows: 4) hold every second micro-batch."""
    path = tiny_checkpoint(arch)
    prompts = make_prompts(5, 256, 2, 14, seed=11)
    tokens, comm = run(path, prompts, attention_ranks=1, expert_ranks=1, micro_batches=2, micro_batch_min_tokens=1,
                       max_num_seqs=5)
    assert tokens == hf_greedy(path, prompts, MAX_NEW)
    (stats,) = graph_stats(comm, 1)
    assert stats["failed"] is None
    assert stats["replays"] >= 2 * (MAX_NEW - 1), stats     # every decode step, both micro-batches
    assert sorted(stats["captured"]) == [[0, 1], [0, 2], [0, 4], [0, 8], [1, 1], [1, 2], [1, 4]]
    assert stats["eager"] == 0, stats


@pytest.mark.parametrize("A,E,comm,balancer", [(1, 3, "direct", "static"), (2, 2, "two_phase", "least_loaded"),
                                               wider(2, 1, "direct", "least_loaded")])
def test_graphs_in_other_topologies(tiny_checkpoint, emulated, A, E, comm, balancer):
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(6, 256, 2, 14, seed=12)
    tokens, stats = run(path, prompts, attention_ranks=A, expert_ranks=E, comm=comm, balancer=balancer,
                        redundant_experts=1 if balancer == "least_loaded" else 0, ranks_per_node=2)
    assert tokens == hf_greedy(path, prompts, MAX_NEW)
    for s in graph_stats(stats, A):
        assert s["failed"] is None and s["replays"] > 0, s


def test_steps_graphs_cannot_hold_run_eagerly_between_replays(tiny_checkpoint, emulated):
    """Prompt logprobs and a chunked long prompt make steps that are not all one-token decodes that sample: those
    run eagerly, the decode steps around them replay, and the tokens and prompt logprobs are the eager engine's."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(3, 256, 2, 10, seed=13) + make_prompts(1, 256, 40, 40, seed=14)
    params = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=1 if i == 1 else None)
              for i in range(4)]
    results = {}
    for eager in (False, True):
        with LLM(path, attention_ranks=1, expert_ranks=1, kernel_backend="torch", max_num_batched_tokens=24,
                 enforce_eager=eager) as llm:
            outs = llm.generate(prompts, params)
            results[eager] = ([o.token_ids for o in outs], outs[1].prompt_logprobs, graph_stats(llm.comm_stats(), 1))
    assert results[False][:2] == results[True][:2]
    (stats,) = results[False][2]
    assert stats["failed"] is None and stats["replays"] > 0
    assert results[True][2] == [None]      # enforce_eager: no graphs at all


def test_graphs_with_ngram_speculation(tiny_checkpoint, emulated):
    """Draft chunks run as decode rows, every row sampled: they replay too (the buckets count rows, not sequences)."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = [(p * 3)[:len(p) * 2 + i] for i, p in enumerate(make_prompts(6, 256, 4, 12, seed=3))]
    with LLM(path, attention_ranks=1, expert_ranks=1, kernel_backend="torch",
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3}) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=2 * MAX_NEW, ignore_eos=True))
        stats, (graphs,) = llm.stats(), graph_stats(llm.comm_stats(), 1)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 2 * MAX_NEW)
    assert stats["spec_decode"]["num_draft_tokens"] > 0, stats["spec_decode"]
    assert graphs["failed"] is None and graphs["replays"] > 0
