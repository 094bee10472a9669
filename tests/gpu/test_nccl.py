"""NCCL between GPUs (skipped on machines with fewer than two): the groups' first collectives, one batched
exchange where two ranks swap CUDA tensors (separate NCCL isend/irecv calls would deadlock), a CPU tensor sent
over NCCL (staged on the GPU), the attention ranks' count gather; then the engine itself at 1+1 and 2+2 with
least_loaded (which gathers counts every layer) and a live re-placement (expert moves over NCCL). The CPU
tests of the same logic are tests/comm/test_p2p.py and test_topology.py."""
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


def _swap_on_gpus(rank: int, world: int) -> tuple[list[float], list[int], list[float]]:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0)
    groups = ProcessGroups.form(store, Topology(rank, world, world, ranks_per_node=world), "nccl", device, 60, 60)
    other = 1 - rank
    sends = [(torch.full((1024,), 10.0 * rank + k, device=device), other) for k in range(3)]
    sends.append((torch.full((4,), -1.0 - rank), other))              # on the host: staged on the GPU
    got = [torch.empty(1024, device=device) for _ in range(3)] + [torch.empty(4)]
    p2p.exchange(sends, [(g, other) for g in got], groups.world)
    counts = torch.empty(2 * 3, dtype=torch.int64, device=device)
    p2p.all_gather_into(counts, torch.arange(3, device=device) + 10 * rank, groups.attention_data)
    return [float(g[0]) for g in got], counts.tolist(), [float(g.device.type == "cuda") for g in got]


def test_two_ranks_swap_cuda_tensors_in_one_exchange_over_nccl():
    (got0, counts0, on0), (got1, counts1, _) = run_ranks(_swap_on_gpus, 2, timeout=120)
    assert got0 == [10.0, 11.0, 12.0, -2.0] and got1 == [0.0, 1.0, 2.0, -1.0]
    assert counts0 == counts1 == [0, 1, 2, 10, 11, 12]
    assert on0 == [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("attention,experts", [(1, 1), (2, 2)])
def test_greedy_tokens_with_a_gpu_per_rank_over_nccl(tiny_checkpoint, attention, experts):
    if torch.cuda.device_count() < attention + experts:
        pytest.skip(f"needs {attention + experts} GPUs")
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(6, 256, 5, 30, seed=5)
    expected = hf_greedy(path, prompts, 16)
    with LLM(path, attention_ranks=attention, expert_ranks=experts, device="cuda", dtype="float32",
             balancer="least_loaded", rebalance_interval=4, kv_cache_memory=64 << 20) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        assert [o.token_ids for o in outs] == expected
