"""The GPU memory plan on a real GPU (skipped without one). Run it alone, not beside other GPU tests: it reads
the GPU's use from this process, which counts every process on the GPU (scripts/gpu_check.sh's `memory`
stage). The oracle is the driver's own count of used memory (torch.cuda.mem_get_info), not the plan's."""
from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams
from models.checkpoint import Checkpoint
from tests.conftest import make_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GiB = 2**30
SLACK = 1 * GiB     # the caching allocator's rounding and the ranks' late allocations (NCCL/IPC, sampling)


def used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.parametrize("A,E", [(1, 1), (2, 1)])
def test_ranks_sharing_a_gpu_fill_their_share_and_stay_within_it(tiny_checkpoint, A, E):
    """All ranks on GPU 0 (cuda_ipc), gpu_memory_utilization=0.5: once up, and after a step at the largest
    batch, the GPU's use is within 0.5 x total (+ slack) and the KV caches took most of it. With 2 attention
    ranks the budget is split evenly between them."""
    total = torch.cuda.mem_get_info()[1]
    budget = 0.5 * total
    path = tiny_checkpoint("qwen3_moe")
    with LLM(path, attention_ranks=A, expert_ranks=E, device="cuda", transport="cuda_ipc",
             gpu_memory_utilization=0.5, max_num_batched_tokens=2048, max_num_seqs=16) as llm:
        up = used()
        prompts = make_prompts(32, 256, 200, 400, seed=5)
        llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        after = used()
        stats = llm.stats()
    layers = Checkpoint(path).spec.num_layers
    kv = [n * stats["kv_bytes_per_token_per_layer"] * 16 * layers for n in stats["kv_blocks"]]
    print(f"A={A} E={E}: budget {budget / GiB:.2f} GiB, used once up {up / GiB:.2f}, after generate "
          f"{after / GiB:.2f}; KV per rank {[round(k / GiB, 2) for k in kv]} GiB")
    assert up <= budget + SLACK and after <= budget + SLACK
    assert sum(kv) >= budget - 4 * GiB           # the tiny model's weights and warm-ups take little
    assert max(stats["kv_blocks"]) - min(stats["kv_blocks"]) <= 1


def test_no_room_fails_the_start_with_the_numbers(tiny_checkpoint):
    with pytest.raises(Exception, match="no room for a KV cache.*gpu_memory_utilization=0.001"):
        LLM(tiny_checkpoint("qwen3_moe"), attention_ranks=1, expert_ranks=1, device="cuda",
            gpu_memory_utilization=0.001).shutdown()
