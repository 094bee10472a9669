"""The persistent InputBatch against the per-step rebuild it replaces (ForwardBatch.from_scheduled, which copies
every table out of the sequences' lists), and against the sequences' own block tables, over a scheduler run that
chunks prompts, preempts, forks samples (copy on write at a shared tail) and admits from the prefix cache."""
from __future__ import annotations

import random

import pytest
import torch

from attention_nodes.batch import ForwardBatch, order_for_batch, split_micro_batches
from attention_nodes.block_pool import BlockPool
from attention_nodes.input_batch import InputBatch
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence, SequenceStatus
from attention_nodes.step_plan import ScheduledSeq

EOS = frozenset({0})
BS = 4
MAX_LEN = 96


def assert_same(got: ForwardBatch, want: ForwardBatch) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "logit_rows"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == torch.int64, name
    assert got.num_decodes == want.num_decodes
    for meta in ("decode", "prefill"):
        g, w = getattr(got, meta), getattr(want, meta)
        assert (g is None) == (w is None), meta
        if g is None:
            continue
        assert torch.equal(g.context_lens, w.context_lens)
        # Blocks a row's context reaches are equal. Past them, where both are that wide, each holds -1 (padding) or
        # the sequence's later blocks (the first piece of a prompt chunk cut between micro-batches has a table wider
        # than its context), the same ones where both hold one.
        width = min(g.block_tables.shape[1], w.block_tables.shape[1])
        for b, n in enumerate(w.context_lens.tolist()):
            used = -(-n // BS)
            assert g.block_tables.shape[1] >= used
            assert g.block_tables[b, :used].tolist() == w.block_tables[b, :used].tolist()
            gt, wt = g.block_tables[b, used:width], w.block_tables[b, used:width]
            assert ((gt == -1) | (wt == -1) | (gt == wt)).all()
    if want.prefill is not None:
        assert torch.equal(got.prefill.cu_seqlens_q, want.prefill.cu_seqlens_q)
        assert got.prefill.host_cu_seqlens == want.prefill.host_cu_seqlens
        assert got.prefill.host_context_lens == want.prefill.host_context_lens
    if want.decode is not None:
        assert got.decode.max_context_len == want.decode.max_context_len


def run(num_blocks: int, prefix_caching: bool, seed: int, micro_batches: int, rows: int = 4) -> tuple[int, int]:
    """Random requests through a scheduler; every step's batches compared -> (preemptions, copies on write)."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks, BS)
    sched = Scheduler(pool, max_num_seqs=6, max_num_batched_tokens=24, enable_prefix_caching=prefix_caching)
    inputs = InputBatch(BS, num_blocks, MAX_LEN, torch.device("cpu"), rows=rows)
    shared = [rng.randrange(1, 50) for _ in range(9)]     # a prefix several prompts share
    arrivals, preemptions, copies = 0, 0, 0
    for _ in range(400):
        if arrivals < 24 and rng.random() < 0.3:
            arrivals += 1
            own = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
            prompt = (shared if rng.random() < 0.5 else []) + own
            n = rng.choice([1, 1, 3])
            params = SamplingParams(max_tokens=rng.randrange(1, 30), n=n, ignore_eos=True,
                                    prompt_logprobs=rng.choice([None, None, 1]),
                                    temperature=rng.choice([0.0, 0.0, 0.7, 1.5]), top_k=rng.choice([0, 5, 10**9]),
                                    top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.1]))
            sched.add(Sequence.from_request(f"r{arrivals}", prompt, params, arrivals))
        if not sched.has_work:
            continue
        versions = {id(s): s.block_table_version for s in list(sched.running) + list(sched.waiting)}
        out = order_for_batch(sched.schedule())
        preemptions += len(out.preempted)
        copies += sum(s.seq.block_table_version > versions.get(id(s.seq), 0) and s.seq.num_computed_tokens > 0
                      for s in out.scheduled)
        inputs.begin_step()
        parts = split_micro_batches(out.scheduled, micro_batches)
        for part in parts:
            assert_same(inputs.prepare(part, "torch"), ForwardBatch.from_scheduled(part, BS, torch.device("cpu")))
        for s in out.scheduled:       # the persistent row is the sequence's table, -1 after it
            row = inputs.table_row(s.seq).tolist()
            n = len(s.seq.block_table)
            assert row[:n] == s.seq.block_table and set(row[n:]) <= {-1}
        to_sample = [s for s in out.scheduled if s.needs_sample]
        for s in [s for s in to_sample if s.seq.needs_fork]:
            children = sched.fork(s, [None] * (s.seq.params.num_samples - 1))
            out.scheduled += children
            to_sample += children
        check_sampling_columns(inputs, [s.seq for s in to_sample])
        sampled = [rng.randrange(1, 50) if s.needs_sample else None for s in out.scheduled]
        sched.update(out, sampled, EOS, MAX_LEN)
    assert arrivals == 24 and not sched.has_work, "the run should finish every request"
    return preemptions, copies


def check_sampling_columns(inputs: InputBatch, seqs: list[Sequence]) -> None:
    """The columns gathered from the rows hold each sequence's own parameters (forked samples included, which
    get their row here); None exactly when all are greedy."""
    columns = inputs.sampling_columns(seqs)
    if all(s.params.temperature == 0 for s in seqs):
        assert columns is None
        return
    assert columns.temperature.tolist() == [torch.tensor(s.params.temperature).item() for s in seqs]
    assert columns.top_k.tolist() == [min(s.params.top_k, 2**24) for s in seqs]
    assert columns.top_k.dtype == torch.int64
    assert columns.top_p.tolist() == [torch.tensor(s.params.top_p).item() for s in seqs]
    assert columns.min_p.tolist() == [torch.tensor(s.params.min_p).item() for s in seqs]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_batches_equal_the_rebuild_through_preemption_forks_and_prefix_hits(prefix_caching, micro_batches):
    preemptions = copies = 0
    for seed in range(3):
        p, c = run(40, prefix_caching, seed, micro_batches)
        preemptions, copies = preemptions + p, copies + c
    assert preemptions > 0 and copies > 0, (preemptions, copies)   # the run did exercise both


def test_a_decode_step_writes_only_the_rows_whose_table_grew():
    pool = BlockPool(64, BS)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    inputs = InputBatch(BS, 64, MAX_LEN, torch.device("cpu"), rows=8)
    for i in range(6):
        sched.add(Sequence.from_request(f"r{i}", [5] * (3 + i), SamplingParams(max_tokens=20, ignore_eos=True), i + 1))
    for step in range(12):
        lengths = {id(s): len(s.block_table) for s in sched.running}
        out = order_for_batch(sched.schedule())
        before = inputs.num_row_writes
        inputs.begin_step()
        inputs.prepare(out.scheduled)
        if step == 0:
            assert inputs.num_row_writes - before == 6      # every row written once, whole
        else:
            grew = sum(len(s.seq.block_table) != lengths[id(s.seq)] for s in out.scheduled)
            assert inputs.num_row_writes - before == grew
        sched.update(out, [7] * len(out.scheduled), EOS, MAX_LEN)


def test_rows_are_reused_after_their_sequences_finish_and_grow_when_all_are_live():
    pool = BlockPool(64, BS)
    inputs = InputBatch(BS, 64, MAX_LEN, torch.device("cpu"), rows=2)

    def live(i: int) -> ScheduledSeq:
        seq = Sequence.from_request(f"r{i}", [5, 6], SamplingParams(), i + 1)
        seq.block_table.extend(pool.allocate(1))
        return ScheduledSeq.from_seq(seq, 2)

    a, b = live(0), live(1)
    inputs.prepare([a, b])
    assert (inputs.num_rows, inputs.capacity) == (2, 2)
    a.seq.status, a.seq.finish_reason = SequenceStatus.FINISHED, "stop"
    c = live(2)
    inputs.prepare([b, c])                      # no free row: the finished sequence's is taken back
    assert (inputs.num_rows, inputs.capacity) == (2, 2)
    assert inputs.table_row(c.seq).tolist()[:2] == [c.seq.block_table[0], -1]
    inputs.prepare([b, c, live(3)])             # all live: the rows double
    assert (inputs.num_rows, inputs.capacity) == (3, 4)
    assert inputs.table_row(b.seq).tolist()[:2] == [b.seq.block_table[0], -1]


def test_a_cache_too_large_for_int32_slots_is_refused():
    with pytest.raises(ValueError, match="overflow int32"):
        InputBatch(16, 2**27, 1024, torch.device("cpu"))


def test_a_step_rewrites_the_staging_buffer_only_after_the_last_steps_copies_ran():
    """On CUDA the staging buffer's copies are queued, not done, when prepare returns, and a step that samples nothing
    reads nothing back: the next step waits for the copy event before it stages again (here a stand-in event, the
    logic CUDA runs with torch.cuda.Event), and only when a copy is pending."""
    log = []

    class Event:
        def record(self):
            log.append("record")

        def synchronize(self):
            log.append("sync")

    pool = BlockPool(64, BS)
    inputs = InputBatch(BS, 64, MAX_LEN, torch.device("cpu"), copy_event=Event())
    seq = Sequence.from_request("r", [5, 6, 7], SamplingParams(), 1)
    seq.block_table.extend(pool.allocate(1))
    inputs.begin_step()
    assert log == []                               # nothing staged yet: no wait
    inputs.prepare([ScheduledSeq.from_seq(seq, 2)])      # a prompt chunk: nothing sampled, nothing read back
    assert log == ["record"]
    inputs.begin_step()
    assert log == ["record", "sync"]               # the chunk's copy ran before its bytes are staged over
    inputs.begin_step()
    assert log == ["record", "sync"]               # no copy since: no wait
    assert InputBatch(BS, 64, MAX_LEN, torch.device("cpu"))._copied is None   # CPU copies are done on return
