"""The leader's side of PD (prefill_ranks): prompts go to prefill ranks only; a request a prefill rank reports
done with its prefill moves to the decode rank with a seat and its blocks free, the longest cached prefix of its
prompt first, then the most free blocks; one with no room waits; losing ranks mid-move settles each moved request
where a rank holds it, or queues it again once the re-sent step shows it did not finish; and the decode rank's
prefix cache learns the blocks it takes over."""
from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import torch

from attention_nodes.block_pool import BlockPool, chain_hashes
from attention_nodes.handover import pack_sequences, plan_take_over, unpack_sequences
from attention_nodes.leader import Leader
from attention_nodes.pd import KVStream, TransferStats, apply_moves, apply_pushes, prefilling_requests, ready_requests
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence
from comm.control import StepHeader, StepReport, pack, unpack

BS = 4


def _leader(num_ranks: int, prefill: int, max_num_seqs: int = 4) -> Leader:
    worker = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=max_num_seqs),
                             report=lambda: StepReport(0, 100, 0, 0, num_blocks=100),
                             kv=SimpleNamespace(bytes_per_token=0))
    return Leader(worker, num_ranks, block_size=BS, cache_aware=True, prefill_ranks=prefill)


def _req(rid: str, prompt: list[int]) -> dict:
    return {"id": rid, "prompt": prompt, "params": SamplingParams(max_tokens=8).to_dict()}


def _ready_at_rank_0(leader: Leader, reports: list[StepReport], ready: list[list]) -> None:
    """Requests a, b, c (3-token prompts) go to prefill rank 0, which then reports `ready` (and `reports`)."""
    for rid in "abc":
        leader.pending.append(_req(rid, [1, 2, 3]))
    leader.next_step({})
    reports[0].ready = ready
    leader.collect(reports, queue.Queue())


def test_prompts_go_to_prefill_ranks_and_move_to_the_decode_rank_with_room():
    leader = _leader(4, prefill=2)     # ranks 0, 1 prefill; 2, 3 decode
    x = list(range(10, 30))
    for rid, prompt in (("a", x), ("b", [1, 2, 3]), ("c", [4, 5, 6]), ("d", x[:12] + [99])):
        leader.pending.append(_req(rid, prompt))
    step = leader.next_step({})
    assert set(step.new_requests) == {"0", "1"} and leader.req2rank == {"a": 0, "b": 1, "c": 1, "d": 1}   # most free
    reps = [StepReport(r, 50, 2, 0) for r in range(4)]
    reps[2].num_free_blocks, reps[3].num_free_blocks = 40, 60
    reps[2].cache_added = chain_hashes(x, BS, limit=3)     # rank 2 caches a's first 3 blocks (d's too)
    reps[0].ready = [["a", 5, 1]]
    reps[1].ready = [["b", 1, 1], ["c", 1, 1], ["d", 4, 1]]
    leader.collect(reps, queue.Queue())
    step = leader.next_step({})
    moves, prefill = step.moves, step.prefill_ranks
    # a and d go to rank 2 for its cached prefix; b and c to rank 3, which has the most free blocks
    assert prefill == 2 and sorted(moves) == [[0, 2, ["a"]], [1, 2, ["d"]], [1, 3, ["b", "c"]]]
    assert leader.req2rank == {"a": 2, "b": 3, "c": 3, "d": 2}


def test_a_request_no_decode_rank_has_room_for_waits():
    leader = _leader(3, prefill=1, max_num_seqs=2)
    _ready_at_rank_0(leader, [StepReport(0, 50, 3, 0), StepReport(1, 3, 0, 0), StepReport(2, 9, 1, 0)],
                     [["a", 4, 1], ["b", 2, 1], ["c", 2, 2]])
    moves = leader.next_step({}).moves
    # a needs 4 blocks: only rank 2 has them (then 5 left and one seat); b fits rank 1; c's two samples need two
    # seats: rank 1 has one left, rank 2 one: c waits
    assert sorted(moves) == [[0, 1, ["b"]], [0, 2, ["a"]]]
    assert leader.stats()["pd"]["requests_waiting_for_decode"] == 1 and leader.req2rank["c"] == 0


def test_a_failed_step_with_moves_settles_them_where_ranks_hold_them():
    """Prefill rank 1 is lost during a step moving a (0 -> 2) and b (1 -> 2). The ranks say rank 2 holds a; b is in
    no rank's hands: it is queued again after the re-sent step's reports (unless they finish it), resumed from
    what it streamed; the re-sent header carries no moves and one prefill rank."""
    leader, outbox = _leader(3, prefill=2), queue.Queue()
    leader.outbox = outbox
    for rid in "ab":
        leader.pending.append(_req(rid, [1, 2, 3]))
    leader.next_step({})
    reps = [StepReport(r, 50, 1, 0) for r in range(3)]
    reps[0].ready, reps[1].ready = [["a", 1, 1]], [["b", 1, 1]]
    reps[0].outputs, reps[1].outputs = [["a", [7], None, None, None, 0]], [["b", [8], None, None, None, 0]]
    leader.collect(reps, outbox)
    leader.inflight = leader.next_step({})
    assert sorted(leader.inflight.moves) == [[0, 2, ["a"]], [1, 2, ["b"]]]
    leader.regroup([0, 2], held={0: [], 2: ["a"]})
    assert leader.inflight.moves == [] and leader.inflight.prefill_ranks == leader.prefill_ranks == 1
    assert leader.req2rank == {"a": 1} and not leader.pending
    leader.collect([StepReport(0, 50, 0, 0), StepReport(1, 50, 1, 0)], outbox)
    (back,) = leader.pending
    assert back["id"] == "b" and back["resume"] == {"0": [8]}


def _worker(num_blocks: int = 8):
    """What pack_sequences / plan_take_over / unpack_sequences touch of an attention worker, prefix caching on."""
    pool = BlockPool(num_blocks, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    kv = SimpleNamespace(tensor=torch.randn(1, 2, num_blocks, BS, 1, 2))
    count = iter(range(1, 100))
    return SimpleNamespace(scheduler=sched, block_pool=pool, kv=kv, device=torch.device("cpu"),
                           next_arrival=lambda: next(count))


def _prefilled(worker, rid: str, prompt: list[int]) -> Sequence:
    seq = Sequence.from_request(rid, prompt, SamplingParams(max_tokens=4), worker.next_arrival())
    worker.scheduler.add(seq)
    worker.scheduler.update(worker.scheduler.schedule(), [42], frozenset(), 64)
    return seq


def _move(src, dst, seqs: list[Sequence]):
    """pack on src; dst reads the description (through msgpack, as over the control group), asks for the blocks
    it needs and takes them over -> its plan."""
    meta, kv = pack_sequences(src, seqs)
    for seq in seqs:      # as the prefill rank does: dropped there (its blocks stay cached)
        src.scheduler.abort(seq.request_id)
    meta = unpack(pack(meta))
    take = plan_take_over(dst, meta)
    unpack_sequences(dst, meta, kv[:, :, take.need].clone(), take)
    return take


def test_the_decode_ranks_prefix_cache_learns_the_blocks_it_takes_over():
    """A sequence of 9 computed tokens (two full blocks) packed on one rank and taken over by another with
    prefix caching on: the second rank's pool finds both blocks under the prompt's keys."""
    src, dst = _worker(), _worker()
    seq = _prefilled(src, "r", list(range(3, 12)))
    meta, kv = pack_sequences(src, [seq])
    assert unpack_sequences(dst, meta, kv, plan_take_over(dst, meta)) == 3
    keys = chain_hashes(seq.token_ids, BS, limit=2)
    (moved,) = dst.scheduler.running
    assert dst.block_pool.lookup(keys) == moved.block_table[:2]
    assert torch.equal(dst.kv.tensor[:, :, moved.block_table], src.kv.tensor[:, :, seq.block_table])


def test_a_move_sends_only_the_blocks_the_decode_rank_does_not_cache():
    """Request a (9 tokens: two full blocks and a partial one) moves first: all three blocks go. Request b shares
    a's first 8 tokens: the decode rank holds those two blocks in its prefix cache, so only b's third block goes,
    b shares a's two blocks there (two holders each), and every block b holds has src's KV for it. With the
    decode rank's pool too full for c's two blocks, c's KV is not asked for at all (c waits, recomputed)."""
    src, dst = _worker(), _worker()
    a = _prefilled(src, "a", list(range(3, 12)))
    first = _move(src, dst, [a])
    assert first.need == [0, 1, 2] and first.have == {}
    b = _prefilled(src, "b", list(range(3, 11)) + [77, 78])
    b_kv = src.kv.tensor[:, :, b.block_table].clone()     # src drops b's blocks as it sends them
    second = _move(src, dst, [b])
    assert second.need == [2] and sorted(second.have) == [0, 1]
    pool = dst.block_pool
    on_a, on_b = (next(q for q in dst.scheduler.running if q.request_id == r) for r in "ab")
    assert on_b.block_table[:2] == on_a.block_table[:2] and on_b.block_table[2] != on_a.block_table[2]
    assert [pool.refcount(x) for x in on_b.block_table] == [2, 2, 1]
    assert torch.equal(dst.kv.tensor[:, :, on_b.block_table], b_kv)
    full = _worker(num_blocks=6)
    full.block_pool.allocate(5)         # held by other requests: one block free, c needs two
    c = _prefilled(src, "c", [9, 9, 9, 9, 9])
    third = _move(src, full, [c])
    assert third.need == [] and not third.keep_kv
    assert [q.request_id for q in full.scheduler.waiting] == ["c"]


def test_a_request_aborted_in_the_step_or_no_longer_on_its_rank_does_not_move():
    """Review findings: an abort for a ready request goes to its prefill rank in the same header, so it must not
    move too (a lost prefill rank would otherwise bring it back); a ready list that names a request the leader
    now has elsewhere (after a handover) is stale for it."""
    leader = _leader(3, prefill=1)
    _ready_at_rank_0(leader, [StepReport(0, 50, 3, 0), StepReport(1, 50, 0, 0), StepReport(2, 50, 0, 0)],
                     [["a", 1, 1], ["b", 1, 1], ["c", 1, 1]])
    leader.req2rank["c"] = 2          # handed over since the report
    moves = leader.next_step({"0": ["a"]}).moves
    assert [rid for _, _, rids in moves for rid in rids] == ["b"]


def test_an_idle_rank_does_not_keep_the_busy_ones_from_splitting_into_micro_batches():
    """micro_batches=2 with at least 16 tokens per micro-batch: a decode rank running 40 sequences splits the step
    while the prefill rank runs nothing (it joins both micro-batches' exchanges empty); once the prefill rank
    gets a 3-token prompt it is the least busy rank that runs tokens, and the step runs whole; so does a decode
    rank with 20 sequences (10 per micro-batch)."""
    worker = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=64),
                             report=lambda: StepReport(0, 100, 0, 0, num_blocks=100),
                             kv=SimpleNamespace(bytes_per_token=0))
    leader = Leader(worker, 2, block_size=BS, micro_batches=2, micro_batch_min_tokens=16, prefill_ranks=1)
    leader.reports = [StepReport(0, 100, 0, 0, max_next_tokens=0, num_blocks=100),
                      StepReport(1, 100, 40, 0, max_next_tokens=40, num_blocks=100)]
    assert leader.next_step({}).micro_batches == 2
    leader.pending.append(_req("a", [1, 2, 3]))
    assert leader.next_step({}).micro_batches == 1
    leader.reports[0].max_next_tokens, leader.reports[1].max_next_tokens = 0, 20
    assert leader.next_step({}).micro_batches == 1


class QueueTransfer:
    """A KVTransfer between two workers of one process, each side in its own thread: what one side sends, the
    other receives (meta through msgpack, as over the control group)."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue):
        self.inbox, self.outbox = inbox, outbox

    def send(self, meta, kv, dst, between=None, accepted=None):
        self.outbox.put(pack(meta))
        need = self.inbox.get(timeout=10)
        if need is not None:
            if accepted is not None:
                accepted()
            self.outbox.put(kv[:, :, need].clone())
        return need

    def recv(self, src, wanted=None):
        meta = unpack(self.inbox.get(timeout=10))
        need = wanted(meta)
        self.outbox.put(need)
        return meta, None if need is None else self.inbox.get(timeout=10)


def _run_moves(src, dst, moves) -> None:
    """apply_moves on both ranks at once, as the step's start runs it on each."""
    a, b = queue.Queue(), queue.Queue()
    errors = []

    def side(worker, transfer):
        try:
            apply_moves(worker, moves, transfer)
        except Exception as e:     # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=side, args=(src, QueueTransfer(a, b))),
               threading.Thread(target=side, args=(dst, QueueTransfer(b, a)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors


def test_a_decode_rank_without_room_refuses_the_move_and_the_prefill_rank_keeps_the_request():
    """The leader's view of the decode rank was older than its last admissions: it has no seat for request a
    when the move comes. It refuses before any KV goes: a stays on the prefill rank with its blocks, still ready
    (never recomputed), and the leader takes it as there again (so it offers it next step). With a seat free,
    the same move goes through."""
    src, dst = _worker(), _worker()
    src.rank, dst.rank = 0, 1
    src.pd_stats, dst.pd_stats = TransferStats(), TransferStats()
    src.scheduler.prefill_only = True
    dst.scheduler.max_num_seqs = 1
    busy = _prefilled(dst, "busy", [5, 6, 7])         # the decode rank's one seat
    a = _prefilled(src, "a", list(range(3, 12)))
    held = list(a.block_table)
    _run_moves(src, dst, [[0, 1, ["a"]]])
    assert [q.request_id for q in src.scheduler.running] == ["a"] and a.block_table == held
    assert ready_requests(src) == [["a", 3, 1]] and dst.pd_stats.requests == 0
    assert [q.request_id for q in dst.scheduler.running] == ["busy"] and dst.scheduler.num_waiting == 0
    leader = _leader(2, prefill=1)
    leader.req2rank["a"] = 1                           # where plan_moves sent it
    leader.inflight = StepHeader("step", step=1, capacity=8, moves=[[0, 1, ["a"]]])
    leader.collect([StepReport(0, 50, 1, 0, ready=ready_requests(src)), StepReport(1, 50, 1, 0)], queue.Queue())
    assert leader.req2rank["a"] == 0
    dst.scheduler.abort(busy.request_id)
    _run_moves(src, dst, [[0, 1, ["a"]]])
    assert not src.scheduler.running and [q.request_id for q in dst.scheduler.running] == ["a"]
    assert dst.pd_stats.requests == 1 and dst.pd_stats.blocks == 3


def test_kv_stream_pushes_each_requests_new_blocks_to_one_decode_rank():
    """KVStream: a request mid-prefill streams to the decode rank caching the longest prefix of it, else with the
    most free blocks, a request placed in the same step counting its prompt's blocks against its rank; the rank
    is chosen once (kept when another frees more); each push carries the full blocks completed since the last; a
    request no longer reported, aborted in the step, or now on another rank pushes nothing, and one no longer
    mid-prefill is forgotten."""
    stream = KVStream()
    reports = [StepReport(0, 50, 2, 0), StepReport(1, 10, 0, 0), StepReport(2, 20, 0, 0)]
    reports[0].prefilling = [["a", 3], ["b", 2]]
    owner, cached = {"a": 0, "b": 0, "c": 0}, {"c": [0, 4, 0]}
    hits = lambda rid: cached.get(rid, [0, 0, 0])    # noqa: E731
    blocks = {"a": 8, "b": 4, "c": 2}.get
    # a (8 blocks) goes to rank 2 (20 free), which then has 12 free against rank 1's 10: b goes there too
    assert stream.plan(reports, 1, owner, hits, blocks, frozenset()) == [[0, 2, [["a", 0, 3], ["b", 0, 2]]]]
    reports[2].num_free_blocks = 5                   # rank 1 has more free now: a stays with rank 2
    reports[0].prefilling = [["a", 5], ["b", 2], ["c", 1]]
    assert stream.plan(reports, 1, owner, hits, blocks, frozenset()) == [[0, 2, [["a", 3, 5]]], [0, 1, [["c", 0, 1]]]]
    owner["c"] = 2
    reports[0].prefilling = [["a", 6], ["b", 4], ["c", 2]]
    assert stream.plan(reports, 1, owner, hits, blocks, frozenset({"b"})) == [[0, 2, [["a", 5, 6]]]]
    assert set(stream.sent) == {"a"}
    reports[0].prefilling = []
    assert stream.plan(reports, 1, owner, hits, blocks, frozenset()) == [] and stream.sent == {}


def test_requests_starting_to_stream_in_one_step_spread_over_the_decode_ranks():
    """Three requests of 8 blocks start streaming together, decode ranks with 20 and 18 free blocks: 2, 1, 2 (the
    free blocks each placement leaves), not all three to rank 2."""
    stream = KVStream()
    reports = [StepReport(0, 50, 3, 0), StepReport(1, 18, 0, 0), StepReport(2, 20, 0, 0)]
    reports[0].prefilling = [["a", 1], ["b", 1], ["c", 1]]
    pushes = stream.plan(reports, 1, dict.fromkeys("abc", 0), lambda rid: [0, 0, 0], lambda rid: 8, frozenset())
    assert pushes == [[0, 2, [["a", 0, 1], ["c", 0, 1]]], [0, 1, [["b", 0, 1]]]]


def _mid_prefill_step(stream: bool) -> Leader:
    """A 1P+1D leader (stream_kv or not) whose prefill rank reported request a with 2 full blocks computed; its
    next header in flight."""
    leader = _leader(2, prefill=1)
    leader.kv_stream = KVStream() if stream else None
    leader.pending.append(_req("a", list(range(20))))
    leader.next_step({})
    reports = [StepReport(0, 50, 1, 0, 64), StepReport(1, 50, 0, 0)]
    reports[0].prefilling = [["a", 2]]
    leader.collect(reports, queue.Queue())
    leader.inflight = leader.next_step({})
    return leader


def test_the_leader_streams_only_with_stream_kv_and_a_re_formed_job_starts_over():
    """Leader(stream_kv=True): a prefill rank's report of a request mid-prefill gives the next header a push;
    without stream_kv none. A regroup empties the in-flight header's pushes and the record of what went where."""
    assert _mid_prefill_step(False).inflight.pushes == []
    leader = _mid_prefill_step(True)
    assert leader.inflight.pushes == [[0, 1, [["a", 0, 2]]]] and leader.kv_stream.sent == {"a": (1, 2)}
    leader.regroup([0, 1])
    assert leader.inflight.pushes == [] and leader.kv_stream.sent == {}


class _Loopback:
    """A KVTransfer between two in-process workers: the receiver's wanted() picks from what was sent."""

    def send(self, meta, kv, dst, between=None, accepted=None):
        self.meta, self.kv = unpack(pack(meta)), kv

    def recv(self, src, wanted=None):
        need = wanted(self.meta)
        return self.meta, self.kv[:, :, need].clone()


def test_a_push_lands_in_the_decode_ranks_prefix_cache_and_the_move_sends_the_rest():
    """A 14-token prompt prefilled 8 tokens at a time: after the first chunk its two full blocks go to the decode
    rank, which caches them unheld (free, findable under the prompt's keys, src's KV); the move at the end of
    the prefill then asks only for blocks 2 and 3, and the request holds src's KV in all four. A second push of
    blocks the decode rank caches already asks for none."""
    src, dst = _worker(), _worker()
    src.scheduler.max_num_batched_tokens = 8
    prompt = list(range(3, 17))
    seq = Sequence.from_request("r", prompt, SamplingParams(max_tokens=4), src.next_arrival())
    src.scheduler.add(seq)
    src.scheduler.update(src.scheduler.schedule(), [None], frozenset(), 64)
    assert prefilling_requests(src) == [["r", 2]]
    link = _Loopback()
    src.rank, dst.rank, dst.pd_stats = 0, 1, TransferStats()
    apply_pushes(src, [[0, 1, [["r", 0, 2]]]], link)
    apply_pushes(dst, [[0, 1, [["r", 0, 2]]]], link)
    pool, keys = dst.block_pool, chain_hashes(prompt, BS, limit=2)
    cached = pool.lookup(keys)
    assert len(cached) == 2 and [pool.refcount(b) for b in cached] == [0, 0] and pool.num_free_blocks == 8
    assert torch.equal(dst.kv.tensor[:, :, cached], src.kv.tensor[:, :, seq.block_table[:2]])
    assert dst.pd_stats.streamed == 2 and dst.pd_stats.streamed_bytes == src.kv.tensor[:, :, :2].numel() * 4
    apply_pushes(src, [[0, 1, [["r", 0, 2]]]], link)
    apply_pushes(dst, [[0, 1, [["r", 0, 2]]]], link)
    assert dst.pd_stats.streamed == 2 and link.meta["num_blocks"] == 2     # sent, but not asked for
    src.scheduler.update(src.scheduler.schedule(), [42], frozenset(), 64)
    src_kv = src.kv.tensor[:, :, seq.block_table].clone()
    take = _move(src, dst, [seq])
    assert take.need == [2, 3] and take.have == {0: cached[0], 1: cached[1]}
    (moved,) = dst.scheduler.running
    assert moved.block_table[:2] == cached and torch.equal(dst.kv.tensor[:, :, moved.block_table], src_kv)


def test_a_later_push_does_not_evict_the_requests_earlier_pushed_blocks():
    """A decode pool of 4 blocks: blocks 0-1 of r pushed, then another request takes and frees the other two (so
    r's are the least recently freed), then blocks 2-3 pushed: the new blocks must not evict 0-1 (a cache lookup
    walks from block 0, so all four would be lost). The two others are the ones reused."""
    src, dst = _worker(), _worker(num_blocks=4)
    src.scheduler.max_num_batched_tokens = 16
    prompt = list(range(3, 21))
    seq = Sequence.from_request("r", prompt, SamplingParams(max_tokens=4), src.next_arrival())
    src.scheduler.add(seq)
    src.scheduler.update(src.scheduler.schedule(), [None], frozenset(), 64)
    link = _Loopback()
    src.rank, dst.rank, dst.pd_stats = 0, 1, TransferStats()
    for push in ([[0, 1, [["r", 0, 2]]]], None, [[0, 1, [["r", 2, 4]]]]):
        if push is None:
            dst.block_pool.free(dst.block_pool.allocate(2))
            continue
        apply_pushes(src, push, link)
        apply_pushes(dst, push, link)
    cached = dst.block_pool.lookup(chain_hashes(prompt, BS, limit=4))
    assert len(cached) == 4 and dst.pd_stats.streamed == 4
    assert torch.equal(dst.kv.tensor[:, :, cached], src.kv.tensor[:, :, seq.block_table[:4]])
