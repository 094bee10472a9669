"""The shared expert runs while the routed experts work: in every MoE layer of every micro-batch, right
after its dispatch starts and before its combine is waited for (attention_nodes/model.py)."""
from __future__ import annotations

import pytest
import torch

from attention_nodes.kv_cache import KVCache
from attention_nodes.model import AttentionModel
from launch.runtime.memory import NoExperts, warmup_batch
from models.checkpoint import Checkpoint


class Recorder(NoExperts):
    """The experts as zeros, recording when each dispatch starts and each combine is waited for."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def start(self, moe_layer, x, ids, weights):
        self.events.append("start")
        return super().start(moe_layer, x, ids, weights)

    def finish(self, pending):
        self.events.append("finish")
        return pending


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_shared_expert_runs_between_dispatch_and_combine(tiny_checkpoint, arch, micro_batches):
    ckpt = Checkpoint(tiny_checkpoint(arch))
    spec, cpu = ckpt.spec, torch.device("cpu")
    assert spec.shared_expert_size
    model = AttentionModel(spec, ckpt.read(ckpt.attention_tensor_names(), torch.float32, cpu), cpu, "torch")
    events: list[str] = []
    mlp = model._mlp

    def recorded(x, prefix):
        if spec.shared_module in prefix:
            events.append("shared")
        return mlp(x, prefix)

    model._mlp = recorded
    batch, blocks = warmup_batch(24, 3, 4096, 16, cpu, "torch")
    kv = KVCache(spec.num_layers, blocks, 16, spec.kv_entry, torch.float32, cpu)
    model.forward([batch] * micro_batches, kv, Recorder(events))
    n = spec.num_moe_layers * micro_batches
    assert events.count("start") == events.count("shared") == events.count("finish") == n
    starts = [i for i, e in enumerate(events) if e == "start"]
    shared = [i for i, e in enumerate(events) if e == "shared"]
    finishes = [i for i, e in enumerate(events) if e == "finish"]
    assert [i + 1 for i in starts] == shared, events          # each right after its dispatch started
    assert all(s < f for s, f in zip(shared, finishes)), events  # and before its combine is waited for
