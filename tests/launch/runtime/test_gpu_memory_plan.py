"""The GPU memory plan's logic on CPU (launch/runtime/memory.py): the KV share of co-located ranks, its error,
when the plan runs, and the warm-up forward every architecture runs before it. tests/gpu/test_memory_plan.py
checks the plan's outcome on a real GPU."""
from __future__ import annotations

import pytest
import torch

from attention_nodes.kv_cache import KVCache, num_blocks_for
from attention_nodes.model import AttentionModel
from expert_nodes.slots import ExpertSlots
from launch.config import CacheConfig
from launch.runtime import memory
from launch.runtime.memory import GpuShare, kv_cache_bytes, warmup_batch
from launch.runtime.sizing import DeviceSettings, num_kv_blocks, plans_gpu_memory
from models.checkpoint import Checkpoint
from models.tiny import ARCHS

GiB = 2**30


def share(gpu="h/0", attention=True, peak=0, used=10 * GiB, total=80 * GiB) -> GpuShare:
    return GpuShare(gpu, attention, peak, used, total)


def test_one_rank_gets_utilization_minus_use_minus_its_peak():
    assert kv_cache_bytes(0, [share(peak=3 * GiB)], 0.9) == int(0.9 * 80 * GiB) - 10 * GiB - 3 * GiB


def test_co_located_ranks_split_what_all_leave():
    """1 attention + 1 expert rank on one GPU, 2 attention ranks on another: each GPU's peaks are summed, and
    its budget is split among its attention ranks only; another GPU's ranks do not count."""
    shares = [share("a", True, 2 * GiB, 20 * GiB), share("b", True, 1 * GiB, 30 * GiB),
              share("b", True, 1 * GiB, 30 * GiB), share("a", False, 5 * GiB, 20 * GiB)]
    assert kv_cache_bytes(0, shares, 0.5) == 40 * GiB - 20 * GiB - 7 * GiB
    assert kv_cache_bytes(1, shares, 0.5) == kv_cache_bytes(2, shares, 0.5) == (40 * GiB - 30 * GiB - 2 * GiB) // 2


def test_the_largest_reading_of_a_gpu_counts():
    """Ranks read the GPU's use one after another; the plan takes the largest (nothing counted twice)."""
    shares = [share(used=11 * GiB), share(attention=False, used=12 * GiB)]
    assert kv_cache_bytes(0, shares, 1.0) == 80 * GiB - 12 * GiB


def test_no_room_names_the_numbers_and_the_way_out():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.2 of 80\.0 GiB.*use 10\.00 GiB.*"
                                         r"peak at 8\.00 GiB.*set kv_cache_memory"):
        kv_cache_bytes(0, [share(peak=8 * GiB)], 0.2)
    with pytest.raises(ValueError, match="expert rank"):
        kv_cache_bytes(1, [share(), share(attention=False)], 0.9)


def test_gpu_memory_utilization_is_checked():
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)
    assert CacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_the_plan_runs_on_cuda_only_when_the_cache_size_is_not_set(tiny_checkpoint):
    spec = Checkpoint(tiny_checkpoint("qwen3_moe")).spec
    cuda = DeviceSettings(torch.device("cuda", 0), torch.bfloat16, "triton", "nccl")
    cpu = DeviceSettings(torch.device("cpu"), torch.float32, "torch", "gloo")
    assert plans_gpu_memory(CacheConfig(), cuda) and not plans_gpu_memory(CacheConfig(), cpu)
    assert not plans_gpu_memory(CacheConfig(kv_cache_memory=1 << 20), cuda)
    assert not plans_gpu_memory(CacheConfig(num_kv_blocks=7), cuda)
    planned = 3 << 30
    assert num_kv_blocks(CacheConfig(), spec, cuda, planned) == num_blocks_for(
        planned, spec.num_layers, 16, spec.kv_entry, torch.bfloat16)
    assert num_kv_blocks(CacheConfig(kv_cache_memory=1 << 20), spec, cuda, planned) == num_blocks_for(
        1 << 20, spec.num_layers, 16, spec.kv_entry, torch.bfloat16)
    with pytest.raises(RuntimeError, match="memory plan"):
        num_kv_blocks(CacheConfig(), spec, cuda)


@pytest.mark.parametrize("tokens,seqs,max_len", [(512, 64, 4096), (100, 7, 4096), (3, 64, 4096), (512, 4, 100)])
def test_warmup_batch_is_the_largest_step(tokens, seqs, max_len):
    batch, blocks = warmup_batch(tokens, seqs, max_len, 16, torch.device("cpu"), "torch")
    n = min(seqs, tokens)
    assert batch.num_tokens == min(tokens, n * max_len)
    assert batch.logit_rows.numel() == n                  # every sequence samples: logits [n, V]
    assert batch.num_decodes == (n if tokens == n else 0)
    used = batch.slot_mapping.div(16, rounding_mode="floor")
    assert used.unique().numel() == blocks and int(used.max()) == blocks - 1   # distinct blocks, no gaps


@pytest.mark.parametrize("arch", ARCHS)
def test_warmup_forward_runs_for_every_architecture(tiny_checkpoint, arch):
    """The warm-up the plan measures, on CPU (where the meter reads 0): the model at its largest step with the
    experts replaced by zeros, and the expert FFN over every row a step may bring."""
    ckpt = Checkpoint(tiny_checkpoint(arch))
    spec = ckpt.spec
    model = AttentionModel(spec, ckpt.read(ckpt.attention_tensor_names(), torch.float32, torch.device("cpu")),
                           torch.device("cpu"), "torch")
    assert memory.attention_peak(model, spec, 64, 5, 4096, 16, torch.float32) == 0
    batch, blocks = warmup_batch(64, 5, 4096, 16, torch.device("cpu"), "torch")
    kv = KVCache(spec.num_layers, blocks, 16, spec.kv_entry, torch.float32, torch.device("cpu"))
    logits = model.forward([batch], kv, memory.NoExperts())
    assert logits.shape == (5, spec.vocab_size) and torch.isfinite(logits).all()
    assert kv.tensor.abs().sum() > 0                       # the forward wrote its K/V
    row = torch.arange(spec.num_experts).repeat(spec.num_moe_layers, 1)
    slots = ExpertSlots.load(ckpt, row, torch.float32, torch.device("cpu"))
    assert memory.expert_peak(slots, 32, spec.top_k, spec.hidden_size, torch.float32, torch.device("cpu")) == 0


@pytest.mark.parametrize("method", ["mtp", "draft_model", "ngram"])
def test_the_kv_budget_holds_the_drafts_cache_too(tmp_path, method):
    """kv_cache_memory (and so the GPU plan's KV bytes) covers the speculative draft's KV cache beside the target's:
    the tensors a worker allocates fit in it, and one block more of each would not."""
    from launch.config import EngineConfig
    from launch.runtime.startup import build_attention_worker, load_attention_model
    from models.tiny import make_tiny_checkpoint, make_tiny_mtp_checkpoint

    path = make_tiny_mtp_checkpoint(tmp_path / "mtp")
    options = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        options["model"] = make_tiny_checkpoint("qwen3_moe", tmp_path / "draft", seed=1, mlp_only_layers=[0, 1])
    budget = 3 << 20
    config = EngineConfig.from_options(path, 1, 1, kv_cache_memory=budget, max_num_seqs=8,
                                       speculative_config=options)
    dev = DeviceSettings(torch.device("cpu"), torch.float32, "torch", "gloo")
    ckpt = Checkpoint(path, mtp=method == "mtp")
    worker = build_attention_worker(config, ckpt.spec, dev, load_attention_model(config, ckpt, dev, "", None), 0,
                                    None, None)
    draft = {"mtp": worker.mtp, "draft_model": worker.drafter.draft, "ngram": None}[method]
    caches = [worker.kv.tensor] + ([] if draft is None else [draft.kv.tensor])
    used = sum(t.numel() * t.element_size() for t in caches)
    per_block = sum(t[:, :, :1].numel() * t.element_size() for t in caches)   # one block of each
    assert used <= budget < used + per_block, (used, per_block)
    if draft is not None:
        assert draft.kv.tensor.shape[2] == worker.block_pool.num_blocks + draft.num_scratch
