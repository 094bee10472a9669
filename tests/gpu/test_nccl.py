"""NCCL between GPUs (skipped on machines with fewer than two): the groups' first collectives, one batched
exchange where two ranks swap CUDA tensors larger than NCCL's buffers (separate isend/irecv calls of such a swap
would deadlock) together with a host tensor (staged on the GPU), the count gather; then the engine with a GPU per
rank: greedy tokens at 1+1, and at 2+2 (four GPUs) with least_loaded, whose counts go over the attention ranks'
NCCL group every layer, and live re-placements that move experts over NCCL. The CPU tests of the same logic are
tests/comm/test_p2p.py and test_topology.py."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from comm import p2p
from comm.topology import ProcessGroups, Topology
from launch import LLM, SamplingParams
from tests.conftest import hf_greedy, make_prompts
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

BIG = 4 << 20     # floats: 16 MiB a message, past NCCL's 4 MiB default buffer


def _swap_on_gpus(rank: int, world: int) -> tuple[list[float], list[int]]:
    """Rank 0 the attention rank, rank 1 the expert rank, each on its own GPU."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0)
    groups = ProcessGroups.form(store, Topology(rank, world, 1, ranks_per_node=world), "nccl", device, 60, 60)
    other = 1 - rank
    sends = [(torch.full((BIG,), 10.0 * rank + k, device=device), other) for k in range(3)]
    sends.append((torch.full((4,), -1.0 - rank), other))              # on the host: staged on the GPU
    got = [torch.empty(BIG, device=device) for _ in range(3)] + [torch.empty(4)]
    p2p.exchange(sends, [(g, other) for g in got], groups.world)
    counts = torch.empty(2 * 3, dtype=torch.int64, device=device)
    p2p.all_gather_into(counts, torch.arange(3, device=device) + 10 * rank, groups.world)
    return [float(g[-1]) for g in got], counts.tolist()


def test_two_ranks_swap_cuda_tensors_in_one_exchange_over_nccl():
    (got0, counts0), (got1, counts1) = run_ranks(_swap_on_gpus, 2, timeout=120)
    assert got0 == [10.0, 11.0, 12.0, -2.0] and got1 == [0.0, 1.0, 2.0, -1.0]
    assert counts0 == counts1 == [0, 1, 2, 10, 11, 12]


@pytest.mark.parametrize("attention,experts", [(1, 1), (2, 2)])
def test_greedy_tokens_with_a_gpu_per_rank_over_nccl(tiny_checkpoint, attention, experts):
    if torch.cuda.device_count() < attention + experts:
        pytest.skip(f"needs {attention + experts} GPUs")
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(8, 256, 3, 40, seed=11)
    expected = hf_greedy(path, prompts, 12)
    with LLM(path, attention_ranks=attention, expert_ranks=experts, device="cuda", dtype="float32",
             balancer="least_loaded", redundant_experts=experts, rebalance_interval=2, max_num_batched_tokens=64,
             kv_cache_memory=64 << 20) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        stats = llm.comm_stats()
    assert [o.token_ids for o in outs] == expected
    if experts > 1:
        assert stats["replacements"] >= 2 and stats["slots_moved"] > 0
