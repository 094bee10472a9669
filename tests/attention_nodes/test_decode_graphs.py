"""Decode graphs (attention_nodes/graphs.py) on the CPU, through RecordedGraph: a decode micro-batch replayed from
its captured graphs gives the eager forward's logits, step after step, as rows, tables and lengths change, in every
architecture; what a graph must not hold (a host sync, a Python value read from one step's data) is caught."""
from __future__ import annotations

import pytest
import torch

from attention_nodes.batch import DecodeMeta, ForwardBatch, split_micro_batches
from attention_nodes.graphs import (SINK_BLOCKS, DecodeGraphs, GraphCaptureError, RecordedGraph, bucket_for,
                                    capture_sizes, slot_rows)
from attention_nodes.kv_cache import KVCache
from attention_nodes.model import AttentionModel
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.sequence import Sequence
from attention_nodes.step_plan import ScheduledSeq
from kernels.paged_attention import plan_decode
from launch.runtime.memory import NoExperts
from models.checkpoint import Checkpoint
from models.tiny import ARCHS

BS, WIDTH, BLOCKS = 4, 6, 64     # block size, table columns (max_model_len 24), pool blocks


class FakeExperts(NoExperts):
    """A MoEContext stand-in: each row's routed output a function of its own x, ids and weights (no ranks), read
    when the combine is waited for, as a transport may read them after start returns."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def start(self, moe_layer, x, ids, weights):
        self.rows.append(x.shape[0])
        return x, ids, weights

    def finish(self, pending):
        x, ids, weights = pending
        return torch.tanh(x) * weights.sum(-1, keepdim=True) + ids.sum(-1, keepdim=True).to(x.dtype) * 1e-3


def decode_batch(gen: torch.Generator, rows: int) -> ForwardBatch:
    """rows decode rows of random lengths (1 .. WIDTH * BS) over distinct random blocks of the pool."""
    lens = torch.randint(1, WIDTH * BS + 1, (rows,), generator=gen)
    blocks = torch.randperm(BLOCKS, generator=gen)[:rows * WIDTH].view(rows, WIDTH).int()
    used = -(-lens.max().item() // BS)
    tables = blocks[:, :used].clone()
    for r in range(rows):
        tables[r, -(-lens[r].item() // BS):] = -1
    pos = (lens - 1).long()
    slots = tables.long().gather(1, (pos // BS)[:, None])[:, 0] * BS + pos % BS
    ids = torch.randint(0, 100, (rows,), generator=gen)
    return ForwardBatch(ids, pos, slots, rows, DecodeMeta(tables, lens.int(), int(lens.max()), None), None,
                        torch.arange(rows), graphable=True)


def eager_and_graphed(model, graphs, batches, eager_kv, graph_kv) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the same micro-batches run eagerly (on eager_kv) and then with graphs (on graph_kv)."""
    model.graphs = None
    eager = model.forward(batches, eager_kv, FakeExperts())
    model.graphs = graphs
    return eager, model.forward(batches, graph_kv, FakeExperts())


def models(tiny_checkpoint, arch: str) -> tuple[AttentionModel, KVCache, KVCache]:
    ckpt = Checkpoint(tiny_checkpoint(arch))
    spec, cpu = ckpt.spec, torch.device("cpu")
    model = AttentionModel(spec, ckpt.read(ckpt.attention_tensor_names(), torch.float32, cpu), cpu, "torch")
    eager_kv = KVCache(spec.num_layers, BLOCKS + SINK_BLOCKS, BS, spec.kv_entry, torch.float32, cpu)
    eager_kv.tensor.normal_(generator=torch.Generator().manual_seed(0))
    graph_kv = KVCache(spec.num_layers, BLOCKS + SINK_BLOCKS, BS, spec.kv_entry, torch.float32, cpu)
    graph_kv.tensor.copy_(eager_kv.tensor)
    return model, eager_kv, graph_kv


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(10_000)[-1] == 512
    assert [bucket_for(n, [1, 2, 4, 8]) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    with pytest.raises(ValueError, match="max_rows=0"):
        capture_sizes(0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_graph_replays_give_the_eager_logits(tiny_checkpoint, arch, micro_batches):
    model, eager_kv, graph_kv = models(tiny_checkpoint, arch)
    # max_rows 16: slot 1 (a split step's second half) holds up to 8 rows, as slot 0 does here
    graphs = DecodeGraphs(model, graph_kv, max_rows=16, width=WIDTH, sink_block=BLOCKS, emulate=True)
    gen = torch.Generator().manual_seed(1)
    for rows in (3, 5, 2, 8, 1, 7):     # buckets 4, 8, 2, 8, 1, 8: shrinking within a bucket pads rows again
        batches = [decode_batch(gen, rows) for _ in range(micro_batches)]
        model.graphs = None
        eager = model.forward(batches, eager_kv, FakeExperts())
        model.graphs = graphs
        experts = FakeExperts()
        replayed = model.forward(batches, graph_kv, experts)
        assert set(experts.rows) == {rows}     # the dispatch sends the step's rows, not the bucket's
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
        # the KV the step wrote, in the pool's blocks (the sink block takes the padding rows' writes)
        torch.testing.assert_close(graph_kv.tensor[:, :, :BLOCKS], eager_kv.tensor[:, :, :BLOCKS], rtol=1e-5,
                                   atol=1e-5)
    stats = graphs.stats()
    assert stats["failed"] is None and stats["replays"] == 6 * micro_batches
    assert sorted({b for _, b in stats["captured"]}) == [1, 2, 4, 8]


def test_a_batch_beyond_the_largest_bucket_or_not_graphable_runs_eagerly(tiny_checkpoint):
    model, _, graph_kv = models(tiny_checkpoint, "qwen3_moe")
    graphs = model.graphs = DecodeGraphs(model, graph_kv, max_rows=4, width=WIDTH, sink_block=BLOCKS, emulate=True)
    gen = torch.Generator().manual_seed(2)
    model.forward([decode_batch(gen, 5)], graph_kv, FakeExperts())
    batch = decode_batch(gen, 3)
    batch.graphable = False
    model.forward([batch], graph_kv, FakeExperts())
    wide = decode_batch(gen, 2)
    wide.decode.block_tables = torch.cat((wide.decode.block_tables, torch.full((2, WIDTH), -1, dtype=torch.int32)), 1)
    model.forward([wide], graph_kv, FakeExperts())
    model.keep_hidden = True      # an MTP layer reads every row's hidden state: the graphs do not keep it
    model.forward([decode_batch(gen, 2)], graph_kv, FakeExperts())
    stats = graphs.stats()
    assert (stats["captured"], stats["replays"], stats["eager"], stats["failed"]) == ([], 0, 2, None)


def random_step(gen: torch.Generator, max_rows: int, drafts: int) -> list[ScheduledSeq]:
    """A step as the scheduler orders it (attention_nodes/batch.py order_for_batch): decode rows first (single
    tokens, or a token and its drafts), at most max_rows of them, then prompt chunks, some ending their prompts."""
    out, rows, target = [], 0, int(torch.randint(1, max_rows + 1, (), generator=gen))
    while True:
        k = int(torch.randint(0, drafts + 1, (), generator=gen)) if drafts else 0
        if rows + 1 + k > target:
            break
        seq = Sequence.from_request(str(len(out)), [1] * 5, SamplingParams(), 0)
        out.append(ScheduledSeq(seq, 1 + k, 4, drafts=[2] * k))
        rows += 1 + k
    for _ in range(int(torch.randint(0, 3, (), generator=gen))):
        n = int(torch.randint(2, 3 * max_rows, (), generator=gen))
        seq = Sequence.from_request(str(len(out)), [1] * (n + int(torch.randint(0, 2, (), generator=gen))),
                                    SamplingParams(), 0)
        out.append(ScheduledSeq.from_seq(seq, n))
    return out


def graphable(part: list[ScheduledSeq]) -> bool:
    """As InputBatch.prepare decides: decode rows only (single tokens or draft chunks), every row sampled."""
    return bool(part) and all((s.num_new_tokens == 1 or s.drafts) and s.needs_sample for s in part)


@pytest.mark.parametrize("drafts", [0, 3])
def test_slot_rows_bounds_every_graphable_micro_batch_of_a_split_step(drafts):
    """The oracle is the engine's own splitter: over random steps of at most max_rows decode rows (with drafts,
    prompt chunks after them) split in 2-4 micro-batches, no graphable micro-batch in slot j holds more rows than
    slot_rows(max_rows, j); slot 0 holds a whole unsplit step, and a step of max_rows single decode rows split in
    j + 1 comes within drafts rows of slot j's bound (reaches it without drafts)."""
    gen = torch.Generator().manual_seed(drafts)
    for max_rows in (1, 5, 16, 64, 200):
        assert slot_rows(max_rows, 0, drafts) == max_rows
        for _ in range(800):
            step = random_step(gen, max_rows, drafts)
            m = int(torch.randint(2, 5, (), generator=gen))
            for j, part in enumerate(split_micro_batches(step, m)):
                rows = sum(s.num_new_tokens for s in part)
                if j and graphable(part):
                    assert rows <= slot_rows(max_rows, j, drafts), (max_rows, m, j, rows, drafts)
    for j in (1, 2, 3):
        step = [ScheduledSeq(Sequence.from_request(str(i), [1] * 5, SamplingParams(), 0), 1, 4) for i in range(64)]
        rows = len(split_micro_batches(step, j + 1)[j])
        assert rows <= slot_rows(64, j, drafts) <= rows + drafts and slot_rows(64, j, drafts) < 64


def test_a_later_slot_captures_only_its_own_buckets(tiny_checkpoint):
    """Slot 1 captures buckets up to slot_rows (here 6 of 12 rows: up to 8), slot 0 up to 12 (16); a slot-1 batch
    above its largest bucket runs eagerly beside a slot-0 replay, with the eager forward's logits."""
    model, eager_kv, graph_kv = models(tiny_checkpoint, "qwen3_moe")
    graphs = model.graphs = DecodeGraphs(model, graph_kv, max_rows=12, width=WIDTH, sink_block=BLOCKS, emulate=True)
    graphs.capture_all(2)
    assert graphs.stats()["captured"] == [[0, b] for b in (1, 2, 4, 8, 16)] + [[1, b] for b in (1, 2, 4, 8)]
    assert graphs._slots[1].batch.input_ids.shape[0] == 8
    gen = torch.Generator().manual_seed(5)
    batches = [decode_batch(gen, 9), decode_batch(gen, 9)]
    eager, replayed = eager_and_graphed(model, graphs, batches, eager_kv, graph_kv)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    stats = graphs.stats()
    assert (len(stats["captured"]), stats["replays"], stats["eager"]) == (9, 1, 1)


def test_capture_all_captures_every_bucket_and_steps_capture_nothing_more(tiny_checkpoint):
    model, eager_kv, graph_kv = models(tiny_checkpoint, "deepseek_v3")
    graphs = model.graphs = DecodeGraphs(model, graph_kv, max_rows=16, width=WIDTH, sink_block=BLOCKS, emulate=True)
    graphs.capture_all(2)
    assert graphs.stats()["captured"] == [[0, b] for b in (1, 2, 4, 8, 16)] + [[1, b] for b in (1, 2, 4, 8)]
    assert graph_kv.tensor[:, :, :BLOCKS].equal(eager_kv.tensor[:, :, :BLOCKS])   # capturing wrote the sink only
    gen = torch.Generator().manual_seed(4)
    for rows in (8, 3, 6):
        batches = [decode_batch(gen, rows), decode_batch(gen, rows - 1)]
        eager, replayed = eager_and_graphed(model, graphs, batches, eager_kv, graph_kv)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert len(graphs.stats()["captured"]) == 9 and graphs.stats()["replays"] == 6


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(tiny_checkpoint, monkeypatch):
    """Slot 0 captures; slot 1's capture meets a router that reads a value back (eager mode can): the rank goes eager
    for good, the step's logits are the eager forward's, and the reason is kept."""
    import attention_nodes.model as model_module
    model, eager_kv, graph_kv = models(tiny_checkpoint, "qwen3_moe")
    graphs = model.graphs = DecodeGraphs(model, graph_kv, max_rows=4, width=WIDTH, sink_block=BLOCKS, emulate=True)
    capture, route = graphs._capture, model_module.route

    def reading_route(*args):
        weights, ids = route(*args)
        assert ids.max().item() >= 0
        return weights, ids

    def second_slot_reads(j, rows):
        if j == 1:
            monkeypatch.setattr(model_module, "route", reading_route)
        return capture(j, rows)
    monkeypatch.setattr(graphs, "_capture", second_slot_reads)
    gen = torch.Generator().manual_seed(5)
    batches = [decode_batch(gen, 3), decode_batch(gen, 2)]
    eager, replayed = eager_and_graphed(model, graphs, batches, eager_kv, graph_kv)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    stats = graphs.stats()
    assert "aten.item" in stats["failed"] and "test_decode_graphs.py" in stats["failed"], stats["failed"]
    assert stats["captured"] == [] and stats["replays"] == 1      # what slot 0 held is let go
    model.forward(batches, graph_kv, FakeExperts())
    assert graphs.stats()["replays"] == 1      # off for good



def test_recorded_graph_replays_on_new_inputs_and_keeps_captured_python_values():
    x = torch.arange(4.0)
    k = 3
    g = RecordedGraph()
    with g.capture():
        y = (x * k).sum()
        z = torch.empty(4)
        torch.add(x, 1, out=z)
    x.copy_(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    k = 5       # a CUDA graph keeps the 3 it saw: so does the stand-in
    g.replay()
    assert y.item() == 12.0 and z.tolist() == [2.0] * 4


def test_a_host_sync_cannot_be_captured():
    x = torch.arange(4.0)
    with pytest.raises(GraphCaptureError, match="test_decode_graphs.py"):
        with RecordedGraph().capture():
            if x.sum() > 0:
                pass
    with pytest.raises(GraphCaptureError, match="nonzero"):
        with RecordedGraph().capture():
            x.nonzero()
    with pytest.raises(GraphCaptureError, match=r"Tensor.tolist\(\) reads tensor data on the host at tests/"):
        with RecordedGraph().capture():
            x.tolist()
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]      # the methods are back once the capture ends


def test_a_value_frozen_from_one_steps_data_gives_wrong_logits(tiny_checkpoint, monkeypatch):
    """What the stand-in is for: a forward that sizes its work from host values of the step it was captured on (here
    the torch decode's grouped plan, made from the capture's context lengths, which gathers one block per row)
    replays them stale, as a CUDA graph would: the logits differ from the eager forward's."""
    model, eager_kv, graph_kv = models(tiny_checkpoint, "qwen3_moe")
    graphs = model.graphs = DecodeGraphs(model, graph_kv, max_rows=4, width=WIDTH, sink_block=BLOCKS, emulate=True)

    def host_plan(batch):
        d = batch.decode
        d.plan = plan_decode(d.block_tables, d.context_lens, BS, group=2, host_lens=[1] * d.context_lens.shape[0])
        return batch
    monkeypatch.setattr(graphs, "_with_plan", host_plan)
    gen = torch.Generator().manual_seed(3)
    batch = decode_batch(gen, 4)
    eager, replayed = eager_and_graphed(model, graphs, [batch], eager_kv, graph_kv)
    assert graphs.stats()["replays"] == 1
    assert (replayed - eager).abs().max() > 1e-3
