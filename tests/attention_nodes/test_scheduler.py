"""Scheduler: token budget, chunked prefill, decode, preemption by recompute, FIFO admission, abort."""
import random
from collections import Counter

import pytest

from attention_nodes.block_pool import BlockPool
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence, SequenceStatus
from attention_nodes.step_plan import ScheduledSeq, SchedulerOutput

EOS = frozenset({2})
MAX_MODEL_LEN = 1000


def make_seq(arrival: int, prompt_len: int, max_tokens: int = 16, **params) -> Sequence:
    return Sequence.from_request(f"r{arrival}", [100 + i for i in range(prompt_len)],
                                 SamplingParams(max_tokens=max_tokens, **params), arrival)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, policy: str = "fcfs") -> Scheduler:
    return Scheduler(BlockPool(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, policy=policy)


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[bool], list]:
    """One engine step sampling `token` wherever needed.

    Returns (output, needs_sample per scheduled seq read before update() grows the seqs, produced).
    """
    out = sched.schedule()
    needs = [s.needs_sample for s in out.scheduled]
    produced = sched.update(out, [token if n else None for n in needs], EOS, MAX_MODEL_LEN)
    return out, needs, produced


def work(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


@pytest.mark.parametrize("kwargs, name", [
    ({"max_num_seqs": 0}, "max_num_seqs=0"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens=0"),
    ({"max_num_batched_tokens": -5}, "max_num_batched_tokens=-5"),
])
def test_bad_limits_raise_value_error(kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_scheduler(**kwargs)


def test_empty_scheduler_has_no_work():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.num_tokens == 0 and out.preempted == []
    assert not sched.has_work and SchedulerOutput.empty().is_empty


def test_add_rejects_duplicates_old_arrivals_and_oversized_prompts():
    sched = make_scheduler(num_blocks=2, block_size=4)
    sched.add(make_seq(5, 3))
    with pytest.raises(ValueError, match="request_id='r5'"):
        sched.add(make_seq(5, 3))
    with pytest.raises(ValueError, match="arrival=4"):
        sched.add(make_seq(4, 3))
    with pytest.raises(ValueError, match="9 prompt tokens needing 3"):
        sched.add(make_seq(6, 9))
    assert sched.num_waiting == 1


def test_token_budget_and_max_num_seqs_are_respected():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    for a in range(5):
        sched.add(make_seq(a, 4))
    out, needs, produced = step(sched)
    assert work(out) == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 2)]
    assert out.num_tokens == 10 and needs == [True, True, False]
    assert [s.request_id for s, _ in produced] == ["r0", "r1"]
    assert sched.num_running == 3 and sched.num_waiting == 2
    out, needs, _ = step(sched)  # decodes for r0/r1, the rest of r2's prompt; no 4th sequence admitted
    assert work(out) == [("r0", 4, 1), ("r1", 4, 1), ("r2", 2, 2)]
    assert sched.num_running == 3 and [s.request_id for s in sched.waiting] == ["r3", "r4"]


def test_budget_exhausted_by_running_skips_later_running_and_admission():
    sched = make_scheduler(max_num_batched_tokens=5)
    sched.add(make_seq(0, 5))
    sched.add(make_seq(1, 5))
    out, needs, _ = step(sched)
    assert work(out) == [("r0", 0, 5)] and sched.num_running == 1
    out, needs, _ = step(sched)  # r0 decodes, r1 gets the remaining 4 tokens as a chunk
    assert work(out) == [("r0", 5, 1), ("r1", 0, 4)] and out.num_tokens == 5


def test_chunked_prefill_samples_only_on_last_chunk_then_decodes():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=4)
    seq = make_seq(0, 10, max_tokens=3)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out, needs, produced = step(sched, token=50)
        [s] = out.scheduled
        chunks.append((s.start, s.num_new_tokens, needs[0], len(seq.block_table), len(produced)))
    assert chunks == [(0, 4, False, 1, 0), (4, 4, False, 2, 0), (8, 2, True, 3, 1)]
    assert seq.num_computed_tokens == 10 and seq.output_token_ids == [50]
    out, needs, produced = step(sched, token=51)  # decode: token 10 goes in, block 3 still has room
    assert work(out) == [("r0", 10, 1)] and needs[0]
    assert produced == [(seq, [51])] and len(seq.block_table) == 3
    out, needs, produced = step(sched, token=52)  # token 11 fills block 3; third output finishes the seq
    assert work(out) == [("r0", 11, 1)] and produced == [(seq, [52])]
    assert seq.finish_reason == "length" and seq.output_token_ids == [50, 51, 52]
    assert not sched.has_work and sched.block_pool.num_free_blocks == 64 and seq.block_table == []


def test_new_decode_block_is_allocated_at_block_boundary():
    sched = make_scheduler(block_size=4)
    seq = make_seq(0, 4)
    sched.add(seq)
    step(sched)
    assert len(seq.block_table) == 1 and seq.num_tokens == 5
    step(sched)  # token 4 goes into a second block
    assert len(seq.block_table) == 2 and sched.block_pool.num_used_blocks == 2


def test_preemption_frees_newest_and_it_recomputes_from_zero():
    sched = make_scheduler(num_blocks=4, block_size=2)
    a, b, c = make_seq(0, 3, max_tokens=3), make_seq(1, 3, max_tokens=3), make_seq(2, 1, max_tokens=2)
    for s in (a, b):
        sched.add(s)
    step(sched, token=60)  # both prefill: 2 blocks each, pool full
    step(sched, token=61)  # both decode token 3, still inside their 2nd block
    sched.add(c)
    assert sched.block_pool.num_free_blocks == 0 and b.output_token_ids == [60, 61]
    out, needs, _ = step(sched, token=62)  # a needs a 3rd block: b (newest) is preempted
    assert out.preempted == [b] and work(out) == [("r0", 4, 1)]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert list(sched.waiting) == [b, c]  # front of waiting, and nobody admitted this step
    assert a.finish_reason == "length" and sched.block_pool.num_free_blocks == 4
    out, needs, _ = step(sched, token=63)  # b re-admitted: recomputes prompt + 2 outputs, then samples
    assert work(out) == [("r1", 0, 5), ("r2", 0, 1)] and needs[0]
    assert b.output_token_ids == [60, 61, 63] and b.finish_reason == "length"
    while sched.has_work:
        step(sched)
    assert sched.block_pool.num_free_blocks == 4


def test_newest_seq_preempts_itself_when_older_ones_took_the_blocks():
    sched = make_scheduler(num_blocks=3, block_size=2)
    a, b = make_seq(0, 3), make_seq(1, 2)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 2 blocks, b: 1 block
    out, needs, _ = step(sched)  # a fits in its blocks; b needs a 2nd block and is the newest
    assert work(out) == [("r0", 3, 1)] and out.preempted == [b]
    assert sched.running == [a] and list(sched.waiting) == [b] and b.num_output_tokens == 1
    assert sched.block_pool.num_used_blocks == 2


def test_admission_is_fifo_without_skipping():
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add(make_seq(0, 8))
    sched.add(make_seq(1, 12))  # needs 3 blocks, only 2 left
    sched.add(make_seq(2, 1))  # would fit, but must not jump the queue
    out, needs, _ = step(sched)
    assert work(out) == [("r0", 0, 8)]
    assert [s.request_id for s in sched.waiting] == ["r1", "r2"]


def test_admission_keeps_arrival_order():
    sched = make_scheduler()
    for a in range(4):
        sched.add(make_seq(a, 2))
    out, needs, _ = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1", "r2", "r3"]
    assert [s.arrival for s in sched.running] == [0, 1, 2, 3]


def test_abort_waiting_and_running_returns_blocks():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    run, wait = make_seq(0, 6), make_seq(1, 2)
    sched.add(run)
    sched.add(wait)
    step(sched)
    assert sched.block_pool.num_used_blocks == 2
    assert sched.abort("r1") == [wait] and sched.num_waiting == 0
    assert sched.abort("r0") == [run] and sched.num_running == 0
    for s in (run, wait):
        assert s.is_finished and s.finish_reason == "abort" and s.block_table == []
    assert sched.block_pool.num_free_blocks == 8 and not sched.has_work
    assert sched.abort("r0") == [] and sched.abort("nope") == []


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort("r0")
    produced = sched.update(out, [5, 6], EOS, MAX_MODEL_LEN)
    assert produced == [(b, [6])] and a.output_token_ids == [] and a.finish_reason == "abort"
    assert sched.running == [b] and sched.block_pool.num_used_blocks == 1


def test_eos_in_update_finishes_and_frees():
    sched = make_scheduler()
    seq = make_seq(0, 3)
    sched.add(seq)
    out, needs, produced = step(sched, token=2)
    assert produced == [(seq, [2])] and seq.finish_reason == "stop"
    assert sched.num_running == 0 and sched.block_pool.num_free_blocks == 64


def test_update_rejects_misaligned_samples():
    sched = make_scheduler(max_num_batched_tokens=2)
    sched.add(make_seq(0, 4))
    out = sched.schedule()
    with pytest.raises(ValueError, match="len\\(sampled\\)=2"):
        sched.update(out, [None, None], EOS, MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="needs_sample=False"):
        sched.update(out, [5], EOS, MAX_MODEL_LEN)


def test_scheduled_seq_records_start():
    seq = make_seq(0, 5)
    seq.num_computed_tokens = 3
    s = ScheduledSeq.from_seq(seq, 2)
    assert s.start == 3 and s.needs_sample
    assert not ScheduledSeq.from_seq(seq, 1).needs_sample


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    pool = sched.block_pool
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs and sched.num_running <= sched.max_num_seqs
    for s in out.scheduled:
        assert s.seq.status is SequenceStatus.RUNNING and s.start == s.seq.num_computed_tokens
        assert len(s.seq.block_table) * pool.block_size >= s.start + s.num_new_tokens
    held = [b for seq in sched.running for b in seq.block_table]
    assert len(held) == len(set(held)) == pool.num_used_blocks
    assert all(seq.block_table == [] for seq in sched.waiting)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_simulated_loop_with_tiny_pool_runs_every_request_to_max_tokens(policy):
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=12, policy=policy)
    all_eos = frozenset(range(100))  # every sampled token is EOS, so ignore_eos is what keeps them going
    pending = [make_seq(a, rng.randint(1, 20), rng.randint(1, 12), ignore_eos=True,
                        priority=rng.randrange(3) if policy == "priority" else 0) for a in range(40)]
    seqs, streamed = list(pending), {s.request_id: [] for s in pending}
    for _ in range(10_000):
        for _ in range(3):
            if pending:
                sched.add(pending.pop(0))
        if not sched.has_work:
            break
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled with work left"
        check_invariants(sched, out)
        sampled = [rng.randrange(100) if s.needs_sample else None for s in out.scheduled]
        for seq, token in sched.update(out, sampled, all_eos, MAX_MODEL_LEN):
            streamed[seq.request_id].extend(token)
    assert not sched.has_work and not pending
    for seq in seqs:
        assert seq.is_finished and seq.finish_reason == "length"
        assert seq.num_output_tokens == seq.params.max_tokens
        assert seq.output_token_ids == streamed[seq.request_id]  # recompute never lost or duplicated a token
        assert seq.block_table == []
    assert sum(s.num_preemptions for s in seqs) > 0  # the pool really was too small
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks


def test_priority_orders_waiting_requests_and_admission():
    """vLLM's priority policy: the lowest priority first, ties by arrival, a later arrival taking its place among
    the waiting ones."""
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    for arrival, priority in enumerate([0, 5, -1, 0]):
        sched.add(make_seq(arrival, 3, max_tokens=2, priority=priority))
    assert [s.request_id for s in sched.waiting] == ["r2", "r0", "r3", "r1"]
    out, _, _ = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["r2", "r0"]
    sched.add(make_seq(4, 3, max_tokens=2, priority=1))       # behind r3 (0), ahead of r1 (5)
    assert [s.request_id for s in sched.waiting] == ["r3", "r4", "r1"]
    finished = []
    while sched.has_work:
        finished += [seq.request_id for seq, _ in step(sched)[2] if seq.is_finished]
    assert finished == ["r2", "r0", "r3", "r4", "r1"]
    with pytest.raises(ValueError, match="policy='lifo' is unknown"):
        make_scheduler(policy="lifo")


@pytest.mark.parametrize("policy, scheduled, preempted, waiting", [
    ("fcfs", [("r0", 7, 1), ("r1", 8, 1)], "r2", ["r2", "r3"]),      # the newest goes, back to the queue's front
    # the least urgent, though scheduled first in the step; it waits behind the more urgent r3
    ("priority", [("r1", 8, 1), ("r2", 3, 1)], "r0", ["r3", "r0"]),
])
def test_priority_preempts_the_least_urgent_running_request(policy, scheduled, preempted, waiting):
    """5 blocks of 4. r0 (priority 5, 6-token prompt) runs alone, then r1 (8 tokens) and r2 (3) join: the pool
    is full, and r3 (priority 1) waits. Next step (a budget of 2 tokens) r0's and r2's tokens fit their blocks but
    r1's ninth needs a third."""
    sched = make_scheduler(num_blocks=5, block_size=4, policy=policy)
    seqs = {"r0": make_seq(0, 6, max_tokens=4, priority=5 if policy == "priority" else 0),
            "r1": make_seq(1, 8, max_tokens=4), "r2": make_seq(2, 3, max_tokens=4),
            "r3": make_seq(3, 3, max_tokens=4, priority=1 if policy == "priority" else 0)}
    sched.add(seqs["r0"])
    step(sched)
    sched.add(seqs["r1"])
    sched.add(seqs["r2"])
    step(sched)
    assert sched.block_pool.num_free_blocks == 0 and [q.num_tokens for q in seqs.values()] == [8, 9, 4, 3]
    sched.add(seqs["r3"])
    sched.max_num_batched_tokens = 2      # two tokens: r2's is the one r0 gives back
    out, _, _ = step(sched, token=70)
    victim = seqs[preempted]
    assert work(out) == scheduled and out.preempted == [victim]
    assert (victim.status, victim.num_computed_tokens, victim.block_table) == (SequenceStatus.WAITING, 0, [])
    assert [q.request_id for q in sched.running] == [q[0] for q in scheduled]
    assert [q.request_id for q in sched.waiting] == waiting
    assert 70 not in victim.output_token_ids        # its taken-back entry drew nothing
    assert all(seqs[rid].output_token_ids[-1] == 70 for rid, _, _ in scheduled)
    while sched.has_work:
        step(sched)
    assert [q.num_output_tokens for q in seqs.values()] == [4, 4, 4, 4] and sched.block_pool.num_free_blocks == 5


@pytest.mark.parametrize("policy, order", [("fcfs", ["r0", "r1", "r2"]), ("priority", ["r0", "r2", "r1"])])
def test_handed_over_waiting_requests_join_the_queue_by_the_policy(policy, order):
    """A handover's waiting request (r2, priority 1) goes behind this rank's (r0: 0, r1: 3) under fcfs, between
    them under priority; arrivals are renumbered in the queue's order, the handed one's last."""
    sched = make_scheduler(policy=policy)
    sched.add(make_seq(0, 3, priority=0))
    sched.add(make_seq(1, 3, priority=3 if policy == "priority" else 0))
    arrivals = iter(range(10, 20))
    sched.take_over([], [make_seq(2, 3, priority=1 if policy == "priority" else 0)], lambda: next(arrivals))
    assert [s.request_id for s in sched.waiting] == order
    assert [s.arrival for s in sched.waiting] == ([10, 12, 11] if policy == "priority" else [10, 11, 12])


def check_shared_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    """check_invariants where samples share blocks: each used block is held once per reference."""
    pool = sched.block_pool
    assert out.num_tokens <= sched.max_num_batched_tokens and len(out.scheduled) <= sched.max_num_seqs
    for s in out.scheduled:
        assert s.seq.status is SequenceStatus.RUNNING and s.start == s.seq.num_computed_tokens
        assert len(s.seq.block_table) * pool.block_size >= s.start + s.num_new_tokens
    held = Counter(b for seq in sched.running for b in seq.block_table)
    assert len(held) == pool.num_used_blocks and all(pool.refcount(b) == n for b, n in held.items())
    assert all(seq.block_table == [] for seq in sched.waiting)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_simulated_loop_with_samples_and_drafts_under_a_tiny_pool(policy, monkeypatch):
    """As above, with requests drawing 2 samples (forked at their first draw, sharing blocks, copying the shared
    tail on write) and running sequences carrying 0-2 drafts (some accepted): under preemption, including the
    priority policy's taking back of a sequence scheduled earlier in its step (this run does, counted), every
    sample gets exactly max_tokens tokens, no block is held twice and every block comes back."""
    taken_back = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, victim, out: taken_back.append(
        (got := preempt(self, victim, out))[1] > 0) or got)
    rng = random.Random(2)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=14, policy=policy)
    pending = [make_seq(a, rng.randint(1, 14), rng.randint(2, 10), ignore_eos=True, n=rng.choice([1, 1, 2]),
                        priority=rng.randrange(4) if policy == "priority" else 0) for a in range(40)]
    everyone = list(pending)
    for _ in range(10_000):
        if pending:
            sched.add(pending.pop(0))
        if not sched.has_work:
            break
        for seq in sched.running:       # drafts for the next step, as a proposer leaves them
            room = seq.params.max_tokens - seq.num_output_tokens - 1
            seq.spec_tokens = [rng.randrange(3, 100) for _ in range(min(room, rng.randrange(3)))] \
                if seq.num_output_tokens else []
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled with work left"
        check_shared_invariants(sched, out)
        for entry in [e for e in out.scheduled if e.needs_sample and e.seq.needs_fork]:     # as the worker does
            forks = sched.fork(entry, [None] * (entry.seq.params.num_samples - 1))
            out.scheduled += forks
            everyone += [f.seq for f in forks]
        sampled = [None if not e.needs_sample else e.drafts[:rng.randrange(len(e.drafts) + 1)] + [7]
                   for e in out.scheduled]
        sched.update(out, sampled, EOS, MAX_MODEL_LEN)
    assert not sched.has_work and not pending
    assert len(everyone) == sum(q.params.num_samples for q in everyone if q.sample_index == 0)
    assert all(q.is_finished and q.num_output_tokens == q.params.max_tokens and q.block_table == []
               for q in everyone)
    assert len(taken_back) > 10 and sched.block_pool.num_free_blocks == 12
    assert any(taken_back) == (policy == "priority")


def test_seq_outgrowing_the_whole_pool_fails_fast():
    sched = make_scheduler(num_blocks=2, block_size=2)
    sched.add(make_seq(0, 4))
    step(sched)  # 5 tokens now need 3 blocks, more than the pool has
    with pytest.raises(RuntimeError, match="needs 3 KV blocks but the pool has 2"):
        sched.schedule()


def test_a_request_that_will_fork_takes_a_seat_per_sample():
    """max_num_seqs=3: r0 runs; r1 (n=3) waits until three seats are free, as its samples run side by side once
    it forks (admitted beside r0, running would reach 4 and break the seat bound)."""
    sched = make_scheduler(max_num_seqs=3)
    sched.add(make_seq(0, 3, max_tokens=2))
    sched.add(make_seq(1, 3, max_tokens=2, n=3))
    out, _, _ = step(sched)
    assert work(out) == [("r0", 0, 3)]
    out, _, _ = step(sched)                     # r0 finishes: now r1 fits
    assert work(out) == [("r0", 3, 1)]
    out = sched.schedule()
    assert work(out) == [("r1#0", 0, 3)]
    out.scheduled += sched.fork(out.scheduled[0], [None, None])
    sched.update(out, [7, 8, 9], EOS, MAX_MODEL_LEN)
    assert [s.request_id for s in sched.running] == ["r1#0", "r1#1", "r1#2"]
    assert len(sched.schedule().scheduled) == 3
