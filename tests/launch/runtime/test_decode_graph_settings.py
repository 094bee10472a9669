"""Which attention ranks use decode graphs, with how many rows, and what the GPU memory plan sets aside for them
(launch/runtime/startup.py, launch/runtime/memory.py)."""
from __future__ import annotations

import pytest
import torch

from attention_nodes.graphs import SINK_BLOCKS, DecodeGraphs
from attention_nodes.kv_cache import KVCache
from attention_nodes.model import AttentionModel
from launch.config import EngineConfig
from launch.runtime.memory import graph_reserve
from launch.runtime.sizing import DeviceSettings
from launch.runtime.startup import decode_graph_rows, uses_decode_graphs
from models.checkpoint import Checkpoint

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def settings(device: torch.device, backend: str) -> DeviceSettings:
    return DeviceSettings(device, torch.float32, backend, "gloo")


def test_graphs_on_cuda_with_triton_unless_eager_or_mtp(tmp_path, monkeypatch):
    monkeypatch.delenv("AFSERVE_GRAPH_EMULATION", raising=False)
    plain = EngineConfig.from_options(str(tmp_path), 1, 1, device="cpu")
    eager = EngineConfig.from_options(str(tmp_path), 1, 1, device="cpu", enforce_eager=True)
    assert uses_decode_graphs(plain, settings(CUDA, "triton"))
    assert not uses_decode_graphs(eager, settings(CUDA, "triton"))
    assert not uses_decode_graphs(plain, settings(CUDA, "torch"))    # the torch decode would gather max_model_len
    assert not uses_decode_graphs(plain, settings(CPU, "torch"))
    monkeypatch.setenv("AFSERVE_GRAPH_EMULATION", "1")
    assert uses_decode_graphs(plain, settings(CPU, "torch"))
    assert not uses_decode_graphs(plain, settings(CPU, "cpu"))       # the C kernels are not aten ops


def test_no_graphs_with_an_mtp_layer(tmp_path, monkeypatch):
    monkeypatch.setattr(type(EngineConfig.from_options(str(tmp_path), 1, 1).scheduler), "uses_mtp", property(
        lambda self: True))
    assert not uses_decode_graphs(EngineConfig.from_options(str(tmp_path), 1, 1), settings(CUDA, "triton"))


@pytest.mark.parametrize("seqs,tokens,spec,rows", [(64, 2048, None, 64), (64, 48, None, 48),
                                                   (16, 2048, {"method": "ngram", "num_speculative_tokens": 3}, 64),
                                                   (256, 1024, {"method": "ngram", "num_speculative_tokens": 3},
                                                    1024)])
def test_decode_graph_rows_is_a_micro_batchs_most_decode_rows(tmp_path, seqs, tokens, spec, rows):
    config = EngineConfig.from_options(str(tmp_path), 1, 1, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                                       speculative_config=spec)
    assert decode_graph_rows(config) == rows


@pytest.mark.parametrize("rows,drafts", [(8, 0), (20, 0), (20, 2)])
def test_graph_reserve_covers_what_the_captured_graphs_hold(tiny_checkpoint, rows, drafts):
    """The oracle is the buffers a capture really allocates (every tensor a slot keeps: static inputs, combine output,
    dispatched rows, logits), here with the CPU stand-in, whose pools the CPU cannot measure (torch keeps no CPU
    allocator peak, so the reserve's pool part reads 0): the reserve covers them for one and two slots, without
    overcounting by more than half, and counts the second slot's smaller buffers where it has fewer rows."""
    ckpt = Checkpoint(tiny_checkpoint("deepseek_v3"))
    spec = ckpt.spec
    model = AttentionModel(spec, ckpt.read(ckpt.attention_tensor_names(), torch.float32, CPU), CPU, "torch")
    bs, max_len = 4, 64
    kv = KVCache(spec.num_layers, 32 + SINK_BLOCKS, bs, spec.kv_entry, torch.float32, CPU)
    graphs = DecodeGraphs(model, kv, rows, -(-max_len // bs), 32, emulate=True, drafts=drafts)
    graphs.capture_all(2)
    assert graphs.stats()["failed"] is None
    for slots in (1, 2):
        held = sum(slot_bytes(graphs._slots[j]) for j in range(slots))
        reserve = graph_reserve(model, spec, rows, slots, bs, max_len, torch.float32, drafts)
        assert held <= reserve <= 1.5 * held, (held, reserve)
    one, two = (graph_reserve(model, spec, rows, n, bs, max_len, torch.float32, drafts) for n in (1, 2))
    assert two < 2 * one, (one, two)


def slot_bytes(slot) -> int:
    b = slot.batch
    tensors = [b.input_ids, b.positions, b.slot_mapping, b.logit_rows, b.decode.block_tables, b.decode.context_lens,
               slot.out, slot.logits, *(t for send in slot.sends for t in send)]
    return sum(t.numel() * t.element_size() for t in tensors)
