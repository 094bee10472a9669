"""Handing an attention rank's live sequences and their KV blocks to another rank (attention_nodes/handover.py):
what runs keeps its tokens, progress, KV content, shared blocks and seeded generator's stream on the new rank,
the scheduler's invariant holds there, and what does not fit (blocks or seats) waits and is recomputed."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from attention_nodes.block_pool import BlockPool
from attention_nodes.handover import pack_sequences, plan_take_over, unpack_sequences
from attention_nodes.kv_cache import KVCache
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence, SequenceStatus
from attention_nodes.step_plan import SchedulerOutput
from comm.control import pack as msg_pack
from comm.control import unpack as msg_unpack

BLOCK = 4
EOS = frozenset({2})
MAX_MODEL_LEN = 1000
SRC_RUNNING = ["a", "b", "c#0", "c#1", "d"]   # the source's running sequences at handover, in order
SRC_WAITING = ["w"]
SRC_BLOCKS = 8                                 # distinct KV blocks they hold (c#0 and c#1 share two)
DECODING = ["a", "b", "c#0", "c#1"]            # d is mid-prefill


def make_worker(num_blocks: int = 32, max_num_seqs: int = 8, max_num_batched_tokens: int = 64) -> SimpleNamespace:
    """What pack_sequences / unpack_sequences touch of an AttentionWorker."""
    pool = BlockPool(num_blocks, BLOCK)
    arrivals = itertools.count(1)
    return SimpleNamespace(scheduler=Scheduler(pool, max_num_seqs, max_num_batched_tokens), block_pool=pool,
                           kv=KVCache(2, num_blocks, BLOCK, (2, 2, 4), torch.float32, torch.device("cpu")),
                           next_arrival=lambda: next(arrivals), device=torch.device("cpu"))


def add(worker, rid: str, prompt_len: int, max_tokens: int = 20, **params) -> None:
    prompt = [100 + 10 * (ord(rid[0]) - ord("a")) + i for i in range(prompt_len)]
    worker.scheduler.add(Sequence.from_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                                               worker.next_arrival()))


def run_step(worker, token_base: int = 1000) -> SchedulerOutput:
    """One AttentionWorker.step without the model: copy-on-write copies, forks (as step() makes them), a draw
    from each sampled seeded sequence's generator (as the sampler's), then update with made-up tokens."""
    sched, pool = worker.scheduler, worker.block_pool
    out = sched.schedule()
    worker.kv.copy_device_blocks(pool.take_copies())
    for s in [s for s in out.scheduled if s.needs_sample and s.seq.needs_fork]:
        p = s.seq.params
        out.scheduled += sched.fork(s, [None if p.seed is None else torch.Generator().manual_seed(p.seed + i)
                                        for i in range(1, p.num_samples)])
    sampled = []
    for i, s in enumerate(out.scheduled):
        if not s.needs_sample:
            sampled.append(None)
            continue
        if s.seq.generator is not None:
            torch.rand(2, generator=s.seq.generator)
        sampled.append(token_base + i)
    sched.update(out, sampled, EOS, MAX_MODEL_LEN)
    return out


def make_source() -> SimpleNamespace:
    """Running: a, b (seeded) decoding; c (n=2, seeded) forked this step, its samples sharing both prompt blocks;
    d mid-prefill. Waiting: w (no seat left). Every block's KV is distinct (arange)."""
    src = make_worker(num_blocks=32, max_num_seqs=5, max_num_batched_tokens=16)
    add(src, "a", 6)
    add(src, "b", 5, seed=1234)
    run_step(src, 1000)
    run_step(src, 1100)
    add(src, "c", 6, n=2, seed=7)
    add(src, "d", 20, max_tokens=4)
    add(src, "w", 3, max_tokens=4)
    run_step(src, 1200)       # a 1, b 1, c 6 (forks), d 8 of 20: budget spent; seats 5 of 5, so w waits
    s = src.scheduler
    assert [q.request_id for q in s.running] == SRC_RUNNING and [q.request_id for q in s.waiting] == SRC_WAITING
    c0, c1 = s.running[2:4]
    assert c0.block_table == c1.block_table and all(src.block_pool.refcount(b) == 2 for b in c0.block_table)
    assert s.running[4].num_computed_tokens == 8 and s.running[4].num_tokens == 20
    src.kv.tensor.copy_(torch.arange(src.kv.tensor.numel(), dtype=torch.float32).reshape(src.kv.tensor.shape))
    return src


def make_destination(**kw) -> SimpleNamespace:
    """Its own x running (decoding, holding blocks 0 and 1), then y and z waiting; KV distinct from the source's."""
    dst = make_worker(**kw)
    add(dst, "x", 5)
    run_step(dst, 2000)
    add(dst, "y", 3, max_tokens=4)
    add(dst, "z", 3, max_tokens=4)
    assert [q.request_id for q in dst.scheduler.running] == ["x"] and dst.scheduler.num_waiting == 2
    dst.kv.tensor.copy_(-1 - torch.arange(dst.kv.tensor.numel(), dtype=torch.float32).reshape(dst.kv.tensor.shape))
    return dst


def hand_over(src, dst) -> int:
    """pack on src, the meta through msgpack as over the control group, the KV into a fresh tensor as recv'd,
    unpack on dst."""
    meta, kv = pack_sequences(src)
    meta = msg_unpack(msg_pack(meta))
    received = torch.empty(meta["shape"], dtype=dst.kv.tensor.dtype)
    received.copy_(kv)
    take = plan_take_over(dst, meta)       # what dst asks for: it has no prefix cache here, so every block it keeps
    return unpack_sequences(dst, meta, received[:, :, take.need], take)


def by_id(sched: Scheduler) -> dict[str, Sequence]:
    return {q.request_id: q for q in list(sched.running) + list(sched.waiting)}


def check_invariant(sched: Scheduler) -> None:
    arrivals = [q.arrival for q in sched.running]
    assert arrivals == sorted(arrivals)
    assert not sched.running or not sched.waiting or max(arrivals) < min(q.arrival for q in sched.waiting)
    assert all(q.status is SequenceStatus.RUNNING for q in sched.running)
    assert all(q.status is SequenceStatus.WAITING and not q.block_table and q.num_computed_tokens == 0
               for q in sched.waiting)


def run_to_completion(worker, max_steps: int = 200) -> dict[str, tuple[int, int]]:
    """Step until nothing is left -> each request's first scheduled (start, num_new_tokens)."""
    first: dict[str, tuple[int, int]] = {}
    for k in range(max_steps):
        if not worker.scheduler.has_work:
            return first
        check_invariant(worker.scheduler)
        out = run_step(worker, 3000 + 100 * k)
        for s in out.scheduled:
            first.setdefault(s.seq.request_id, (s.start, s.num_new_tokens))
    raise AssertionError(f"still running after {max_steps} steps")


def test_running_sequences_keep_tokens_progress_and_kv_content():
    src, dst = make_source(), make_destination()
    before = {rid: (list(q.token_ids), q.num_computed_tokens, q.num_prompt_tokens, list(q.block_table))
              for rid, q in by_id(src.scheduler).items()}
    for i, q in enumerate(src.scheduler.running):    # as prefix-cache hits at their first admission would set
        q.num_cached_tokens = 4 * i
    x_blocks = list(dst.scheduler.running[0].block_table)
    x_kv = dst.kv.tensor[:, :, x_blocks].clone()
    free_before = dst.block_pool.num_free_blocks

    assert hand_over(src, dst) == SRC_BLOCKS
    assert dst.block_pool.num_free_blocks == free_before - SRC_BLOCKS
    got = by_id(dst.scheduler)
    assert set(got) == {"x", "y", "z", *SRC_RUNNING, *SRC_WAITING}
    seen = set()
    for rid in SRC_RUNNING:
        tokens, computed, prompt, src_blocks = before[rid]
        q = got[rid]
        assert q.status is SequenceStatus.RUNNING
        assert (q.token_ids, q.num_computed_tokens, q.num_prompt_tokens) == (tokens, computed, prompt)
        assert len(q.block_table) == len(src_blocks) == dst.block_pool.blocks_needed(computed)
        for sb, db in zip(src_blocks, q.block_table):
            assert torch.equal(dst.kv.tensor[:, :, db], src.kv.tensor[:, :, sb]), (rid, sb, db)
        seen.update(q.block_table)
    assert len(seen) == SRC_BLOCKS and not seen & set(x_blocks)
    assert torch.equal(dst.kv.tensor[:, :, x_blocks], x_kv)      # the destination's own KV is left alone
    w = got["w"]
    assert (w.token_ids, w.num_computed_tokens, w.block_table) == (before["w"][0], 0, [])
    assert w.status is SequenceStatus.WAITING
    # Sampling state travels too: the n=2 request's samples stay forked (no second fork on the destination).
    assert [(got[r].group_id, got[r].sample_index, got[r].forked) for r in ("c#0", "c#1")] == \
        [("c", 0, True), ("c", 1, True)]
    assert got["a"].params == src.scheduler.running[0].params
    # and how much of each prompt was found cached when first admitted (the front reports it: vLLM's usage)
    assert [got[r].num_cached_tokens for r in SRC_RUNNING + SRC_WAITING] == [0, 4, 8, 12, 16, None]


def test_shared_blocks_stay_shared_and_free_back_to_the_pool():
    src, dst = make_source(), make_destination()
    free_before = dst.block_pool.num_free_blocks
    assert hand_over(src, dst) == SRC_BLOCKS
    pool, got = dst.block_pool, by_id(dst.scheduler)
    c0, c1 = got["c#0"], got["c#1"]
    assert c0.block_table[0] == c1.block_table[0]
    assert c0.block_table == c1.block_table                  # both prompt blocks, the partly filled tail too
    assert all(pool.refcount(b) == 2 for b in c0.block_table)
    assert all(pool.refcount(b) == 1 for r in ("a", "b", "d") for b in got[r].block_table)
    # One sample going frees nothing the other holds; the second frees the request's blocks.
    assert dst.scheduler.abort("c#0") == [c0]
    assert pool.num_free_blocks == free_before - SRC_BLOCKS
    assert all(pool.refcount(b) == 1 for b in c1.block_table)
    assert dst.scheduler.abort("c") == [c1]
    assert pool.num_free_blocks == free_before - SRC_BLOCKS + 2
    for rid in ("a", "b", "d", "w"):
        assert len(dst.scheduler.abort(rid)) == 1
    assert pool.num_free_blocks == free_before               # what x holds is all that stays taken
    assert pool.num_free_blocks == pool.num_blocks - len(dst.scheduler.running[0].block_table)


def test_seeded_generators_continue_their_stream():
    src, dst = make_source(), make_destination()
    src_seqs = by_id(src.scheduler)
    seeded = {rid: q for rid, q in src_seqs.items() if q.generator is not None}
    assert set(seeded) == {"b", "c#0", "c#1"}
    states = {rid: q.generator.get_state().clone() for rid, q in seeded.items()}
    assert hand_over(src, dst) == SRC_BLOCKS
    got = by_id(dst.scheduler)
    for rid, q in seeded.items():
        ref = torch.Generator()
        ref.set_state(states[rid])
        expected = torch.rand(3, generator=ref)
        assert got[rid].generator is not q.generator
        assert torch.equal(torch.rand(3, generator=got[rid].generator), expected), rid
        assert torch.equal(torch.rand(3, generator=q.generator), expected), rid   # the source's own, after packing
    # The stream had moved on from its seed: a restarted generator would draw something else.
    fresh = torch.rand(3, generator=torch.Generator().manual_seed(1234))
    ref = torch.Generator()
    ref.set_state(states["b"])
    assert not torch.equal(torch.rand(3, generator=ref), fresh)
    assert got["a"].generator is None


def test_destination_scheduler_invariant_and_next_schedule():
    src, dst = make_source(), make_destination()
    computed = {rid: q.num_computed_tokens for rid, q in by_id(src.scheduler).items()}
    y, z = dst.scheduler.waiting
    assert hand_over(src, dst) == SRC_BLOCKS
    sched = dst.scheduler
    assert [q.request_id for q in sched.running] == ["x", *SRC_RUNNING]
    assert [q.request_id for q in sched.waiting] == ["y", "z", *SRC_WAITING]
    assert sched.waiting[0] is y and sched.waiting[1] is z
    check_invariant(sched)
    # A request added later still gets a later arrival than everything handed over.
    add(dst, "v", 3, max_tokens=4)
    check_invariant(sched)

    got = by_id(sched)
    shared_tail = got["c#0"].block_table[1]
    out = sched.schedule()
    work = {s.seq.request_id: (s.start, s.num_new_tokens) for s in out.scheduled}
    assert not out.preempted
    for rid in DECODING:
        assert work[rid] == (computed[rid], 1), rid
    assert work["d"] == (8, 12)                                # the rest of its prompt
    assert work["x"][1] == 1 and "y" in work and "z" in work and "w" not in work   # 8 seats: y, z admitted
    # The first sample writes into the shared tail: copy on write, the second keeps the original.
    assert dst.block_pool.take_copies() == [(shared_tail, got["c#0"].block_table[1])]
    assert got["c#1"].block_table[1] == shared_tail and dst.block_pool.refcount(shared_tail) == 1
    sched.update(out, [4000 + i if s.needs_sample else None for i, s in enumerate(out.scheduled)], EOS, MAX_MODEL_LEN)

    run_to_completion(dst)
    assert dst.block_pool.num_free_blocks == dst.block_pool.num_blocks
    for rid in ("a", "b", "c#0", "c#1", "d", "w"):
        q = got[rid]
        assert q.is_finished and q.finish_reason == "length" and q.num_output_tokens == q.params.max_tokens, rid


@pytest.mark.parametrize("num_blocks, keeps", [(2 + SRC_BLOCKS, True), (1 + SRC_BLOCKS, False)])
def test_without_room_for_the_blocks_everything_waits_and_is_recomputed(num_blocks, keeps):
    src, dst = make_source(), make_destination(num_blocks=num_blocks)   # x holds 2 blocks
    before = {rid: (list(q.token_ids), q.num_prompt_tokens) for rid, q in by_id(src.scheduler).items()}
    gen_state = by_id(src.scheduler)["b"].generator.get_state().clone()
    free_before = dst.block_pool.num_free_blocks
    moved = hand_over(src, dst)
    sched = dst.scheduler
    got = by_id(sched)
    assert set(got) == {"x", "y", "z", *before}                  # nothing lost
    check_invariant(sched)
    if keeps:
        assert moved == SRC_BLOCKS and dst.block_pool.num_free_blocks == 0
        return
    assert moved == 0 and dst.block_pool.num_free_blocks == free_before
    assert [q.request_id for q in sched.running] == ["x"]
    assert [q.request_id for q in sched.waiting] == ["y", "z", *SRC_RUNNING, *SRC_WAITING]
    for rid, (tokens, prompt) in before.items():
        q = got[rid]
        assert q.status is SequenceStatus.WAITING and q.num_computed_tokens == 0 and q.block_table == []
        assert (q.token_ids, q.num_prompt_tokens) == (tokens, prompt)
    ref = torch.Generator()
    ref.set_state(gen_state)
    assert torch.equal(got["b"].generator.get_state(), ref.get_state())

    first = run_to_completion(dst)
    for rid, (tokens, _) in before.items():
        assert first[rid] == (0, len(tokens)), rid                 # prefill of prompt + generated tokens
        q = got[rid]
        assert q.token_ids[:len(tokens)] == tokens and q.is_finished and q.finish_reason == "length", rid
    assert dst.block_pool.num_free_blocks == dst.block_pool.num_blocks


@pytest.mark.parametrize("max_num_seqs, keeps", [(1 + len(SRC_RUNNING), True), (len(SRC_RUNNING), False)])
def test_without_seats_for_the_running_ones_they_wait(max_num_seqs, keeps):
    src, dst = make_source(), make_destination(max_num_seqs=max_num_seqs)   # x takes one seat
    free_before = dst.block_pool.num_free_blocks
    moved = hand_over(src, dst)
    sched = dst.scheduler
    check_invariant(sched)
    assert set(by_id(sched)) == {"x", "y", "z", *SRC_RUNNING, *SRC_WAITING}
    if keeps:
        assert moved == SRC_BLOCKS and [q.request_id for q in sched.running] == ["x", *SRC_RUNNING]
    else:
        assert moved == 0 and dst.block_pool.num_free_blocks == free_before
        assert [q.request_id for q in sched.running] == ["x"]
        assert [q.request_id for q in sched.waiting] == ["y", "z", *SRC_RUNNING, *SRC_WAITING]
    first = run_to_completion(dst)
    if not keeps:
        assert all(first[rid][0] == 0 for rid in SRC_RUNNING)
    assert dst.block_pool.num_free_blocks == dst.block_pool.num_blocks


def test_an_idle_rank_hands_over_nothing():
    src, dst = make_worker(), make_destination()
    meta, kv = pack_sequences(src)
    assert meta["seqs"] == [] and meta["num_blocks"] == 0 and kv.shape[2] == 0
    free_before = dst.block_pool.num_free_blocks
    assert hand_over(src, dst) == 0
    assert dst.block_pool.num_free_blocks == free_before
    assert [q.request_id for q in dst.scheduler.running] == ["x"]
    assert [q.request_id for q in dst.scheduler.waiting] == ["y", "z"]
    check_invariant(dst.scheduler)
