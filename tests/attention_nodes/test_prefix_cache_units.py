"""The prefix cache's parts: block keys, the pool's cached blocks and eviction order, the host tier's books and
copies, and the scheduler's admission from a cached prefix."""
import torch

from attention_nodes.block_pool import BlockPool, chain_hashes, hash_block
from attention_nodes.host_tier import LOAD, SAVE, HostTier
from attention_nodes.kv_cache import KVCache
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence

EOS = frozenset({2})


def test_keys_chain_whole_prefixes():
    a = chain_hashes([5, 6, 7, 8, 9, 10, 11, 12, 13], 4)
    b = chain_hashes([5, 6, 7, 8, 9, 10, 11, 12], 4)
    c = chain_hashes([0, 6, 7, 8, 9, 10, 11, 12], 4)
    assert len(a) == 2 and a == b                       # the partial third block has no key
    assert c[1] != a[1]                                 # same second block, different first: different key
    assert hash_block(None, [1, 2]) != hash_block(0, [1, 2])   # no parent is not parent 0
    known = chain_hashes([5, 6, 7, 8], 4)
    assert chain_hashes([5, 6, 7, 8, 9, 10, 11, 12], 4, known) is known and known == a
    assert chain_hashes([5, 6, 7, 8, 9, 10, 11, 12], 4, limit=1) == a[:1]


def test_cached_blocks_survive_free_and_are_evicted_least_recently_freed_first():
    pool = BlockPool(4, 2, track_events=True)
    seq_a, seq_b = pool.allocate(2), pool.allocate(2)
    pool.register(seq_a[0], 100)
    pool.register(seq_a[1], 101)
    assert not pool.register(seq_b[0], 100)             # the key is taken: stays unregistered
    pool.free(reversed(seq_a))
    assert pool.num_free_blocks == 2 and pool.lookup([100, 101, 102]) == seq_a
    assert pool.num_revived(seq_a) == 2
    pool.take(seq_a[:1])                                # revived out of the free queue
    assert pool.refcount(seq_a[0]) == 1 and pool.num_free_blocks == 1
    assert pool.allocate(1) == [seq_a[1]]               # the only free block: evicts key 101
    assert pool.lookup([100, 101]) == [seq_a[0]]
    assert pool.take_events() == ([100], [])           # 101 came and went since the last call: neither
    assert pool.take_events() == ([], [])
    pool.free([seq_a[0]])
    pool.allocate(1)                                    # evicts 100, added before the last call
    assert pool.take_events() == ([], [100])


def test_events_applied_evictions_first_give_the_pool_as_it_is():
    """The leader mirrors a rank's cache by removing the evicted keys, then adding the added ones. A key added and
    evicted since the last report (a PD push, then this step's schedule) must not stay in the mirror; one
    evicted, added again and kept must."""
    pool = BlockPool(3, 1, track_events=True)
    a = pool.allocate(1)
    pool.register(a[0], 7)
    pool.free(a)
    mirror = set(pool.take_events()[0])
    b = pool.allocate(3)                                # evicts 7, then 7 comes back in another block
    pool.register(b[1], 7)
    pool.register(b[2], 8)
    pool.free([b[2]])
    pool.allocate(1)                                    # evicts 8, added since the last call
    added, evicted = pool.take_events()
    mirror.difference_update(evicted)
    mirror.update(added)
    assert mirror == {7} and pool.holds(7) and not pool.holds(8)


def test_free_order_decides_which_cached_block_goes_first():
    pool = BlockPool(3, 1)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, 10 + i)
    pool.free(reversed(blocks))                         # the tail first: evicted first, the head kept longest
    pool.allocate(2)
    assert pool.lookup([10]) == [blocks[0]] and pool.lookup([11]) == [] and pool.lookup([12]) == []


def test_reset_cache_forgets_held_and_free_blocks_and_empties_the_host_tier():
    """reset_cache (LLM.reset_prefix_cache): no key is found any more, refcounts and the free queue are as they were,
    reusing a formerly cached block is no eviction (no event, no host save), the pending events go, and a held block
    can be registered again afterwards."""
    host = HostTier(4)
    pool = BlockPool(4, 2, host=host, track_events=True)
    held, freed = pool.allocate(2), pool.allocate(2)
    for b, key in zip(held + freed, (100, 101, 200, 201)):
        pool.register(b, key)
    pool.free(reversed(freed))
    host.save(300, block=3)                             # a copy still to make when the reset comes
    assert pool.reset_cache() == 4
    assert pool.lookup([100]) == pool.lookup([200]) == [] and pool.num_cached_blocks == 0
    assert [pool.refcount(b) for b in held + freed] == [1, 1, 0, 0] and pool.num_free_blocks == 2
    assert pool.take_events() == ([], []) and len(host) == 0 and 300 not in host
    assert host.take_ops() == [(SAVE, 3, 0)]            # made in order: a later save into slot 0 comes after it
    assert pool.allocate(2) == freed[::-1]              # reused with no eviction: nothing saved to the host
    assert host.take_ops() == [] and pool.take_events() == ([], [])
    assert pool.register(held[0], 100) and pool.lookup([100]) == [held[0]]
    host.save(400, block=1)
    assert host.take_ops() == [(SAVE, 1, 0)]            # every slot free again, the first one first


def test_host_tier_keeps_lru_copies_and_never_reuses_a_pinned_slot():
    host = HostTier(2)
    host.save(1, block=7)
    host.save(2, block=8)
    host.save(1, block=9)                               # already held: no copy, just used
    assert host.take_ops() == [(SAVE, 7, 0), (SAVE, 8, 1)]
    host.pin([2])
    host.save(3, block=5)                               # full: evicts 1 (2 is pinned, and more recent anyway)
    host.save(4, block=6)                               # only pinned 2 and fresh 3 are left to evict: 3 goes
    assert 1 not in host and 2 in host and 4 in host and 3 not in host
    assert host.match([2, 4, 1]) == 2
    host.restore([2], [11])
    assert host.take_ops() == [(SAVE, 5, 0), (SAVE, 6, 0), (LOAD, 1, 11)]
    assert (host.num_saved, host.num_restored) == (4, 1)


def test_copy_blocks_round_trips_and_keeps_the_later_save_of_a_slot():
    kv = KVCache(2, 4, 2, (2, 1, 3), torch.float32, torch.device("cpu"), host_blocks=2)
    kv.tensor.copy_(torch.randn_like(kv.tensor))
    want = kv.tensor[:, :, 3].clone()
    kv.copy_blocks([(SAVE, 1, 0), (SAVE, 3, 0), (LOAD, 0, 2)])
    assert torch.equal(kv.host[:, :, 0], want) and torch.equal(kv.tensor[:, :, 2], want)


def make_seq(rid: str, tokens: list[int], arrival: int, **params) -> Sequence:
    return Sequence.from_request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True, **params), arrival)


def run_to_end(sched: Scheduler) -> None:
    for _ in range(100):
        if not sched.has_work:
            return
        out = sched.schedule()
        sched.update(out, [7 if s.needs_sample else None for s in out.scheduled], EOS, 1000)
    raise AssertionError("did not finish in 100 steps")


def test_admission_starts_after_the_cached_prefix_and_computes_the_last_token():
    sched = Scheduler(BlockPool(16, 4), 8, 64, enable_prefix_caching=True)
    prompt = list(range(10, 22))                        # 12 tokens: 3 whole blocks
    sched.add(make_seq("a", prompt, 1))
    run_to_end(sched)
    sched.add(make_seq("b", prompt, 2))                 # all 3 blocks cached; the last one is computed again
    sched.add(make_seq("c", prompt[:9] + [99, 98], 3))  # 2 blocks shared
    sched.add(make_seq("d", prompt, 4, prompt_logprobs=0))   # scores every prompt token: no lookup
    out = sched.schedule()
    assert [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("b", 8, 4), ("c", 8, 3), ("d", 0, 12)]
    assert sched.num_prefix_hits == 16 and sched.num_prefix_queries == 12 + 12 + 11   # a, b, c
    b, c = out.scheduled[0].seq, out.scheduled[1].seq
    assert b.block_table[:2] == c.block_table[:2] and b.block_table[2] != c.block_table[2]
    assert sched.block_pool.refcount(b.block_table[0]) == 2


def test_a_request_keeps_the_cached_count_of_its_first_admission():
    """vLLM's num_cached_tokens: what a request found cached when first admitted. b, admitted with nothing
    cached, is preempted once a needs a third block; when it comes back it finds its own two prompt blocks (the
    rank's hit counter says so) but still reports 0. c, sharing a's first block, reports 4."""
    sched = Scheduler(BlockPool(5, 4), 8, 64, enable_prefix_caching=True)
    a, b = make_seq("a", list(range(10, 18)), 1), make_seq("b", list(range(30, 38)), 2)
    assert a.num_cached_tokens is None       # not admitted yet
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, [7, 7], EOS, 1000)
    out = sched.schedule()
    assert out.preempted == [b] and (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
    sched.update(out, [7], EOS, 1000)
    hits = sched.num_prefix_hits
    run_to_end(sched)
    assert sched.num_prefix_hits - hits == 8 and b.num_preemptions == 1 and b.num_cached_tokens == 0
    c = make_seq("c", list(range(10, 14)) + [50, 51, 52], 3)
    sched.add(c)
    run_to_end(sched)
    assert c.num_cached_tokens == 4


def test_a_failed_admission_changes_nothing():
    pool = BlockPool(4, 4)
    sched = Scheduler(pool, 8, 64, enable_prefix_caching=True)
    sched.add(make_seq("a", list(range(10, 19)), 1))    # 9 tokens + 4 new: 3 blocks
    run_to_end(sched)
    sched.add(make_seq("hog", list(range(50, 62)), 2))  # takes 3 blocks, evicting one of a's
    sched.schedule()
    sched.add(make_seq("b", list(range(10, 19)) + [1, 2, 3, 4, 5, 6, 7], 3))
    free = pool.num_free_blocks
    assert not sched.schedule().scheduled[1:]           # b does not fit beside hog
    assert pool.num_free_blocks == free and sched.waiting[0].block_table == []


def test_fork_shares_blocks_and_copies_the_shared_tail_before_writing():
    """A 6-token prompt (block size 4) drawing 3 samples: at its first draw the samples share both blocks; at
    the next step two of them copy the half-filled second block (the third, its last holder, writes in place),
    and the full first block stays shared."""
    pool = BlockPool(16, 4)
    sched = Scheduler(pool, 8, 64, enable_prefix_caching=True)
    sched.add(Sequence.from_request("g", list(range(10, 16)), SamplingParams(max_tokens=3, n=2, best_of=3), 1))
    out = sched.schedule()
    (parent_entry,) = out.scheduled
    forks = sched.fork(parent_entry, [None, None])
    out.scheduled += forks
    parent = parent_entry.seq
    assert [s.seq.request_id for s in out.scheduled] == ["g#0", "g#1", "g#2"]
    table = list(parent.block_table)
    assert all(s.seq.block_table == table for s in forks) and [pool.refcount(b) for b in table] == [3, 3]
    sched.update(out, [7, 8, 9], EOS, 1000)
    assert [s.token_ids[-1] for s in sched.running] == [7, 8, 9]
    out = sched.schedule()
    tails = [s.seq.block_table[1] for s in out.scheduled]
    assert len(set(tails)) == 3 and table[1] in tails
    assert all(s.seq.block_table[0] == table[0] for s in out.scheduled) and pool.refcount(table[0]) == 3
    copies = pool.take_copies()
    assert sorted(src for src, _ in copies) == [table[1], table[1]] and {d for _, d in copies} == set(tails) - {
        table[1]}
    assert [s.request_id for s in sched.abort("g")] == ["g#0", "g#1", "g#2"]
    assert pool.num_free_blocks == 16
