"""attention_nodes/speculation.py and the scheduler's side of speculative decoding: the configuration's errors,
the drafter's bounds, a draft chunk scheduled, batched and rolled back, and the engine's verification (`emit`)
emitting the target's distribution (chi-square) with greedy rows exact and seeded rows independent of the batch."""
from __future__ import annotations

import itertools

import pytest
import torch

from attention_nodes.batch import ForwardBatch, order_for_batch, split_micro_batches
from attention_nodes.block_pool import BlockPool
from attention_nodes.input_batch import InputBatch
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence, seeded_generator
from attention_nodes.speculation import Drafter, SpeculativeConfig, SpecStats, emit, summed
from tests.attention_nodes.test_spec_decode import _p_value
from tests.host_reads import no_host_reads

EOS = frozenset({0})
BS = 4


@pytest.mark.parametrize("given, named", [
    ({"method": "eagle", "num_speculative_tokens": 1}, "method='eagle' is not supported yet"),
    ({"method": "mtp", "num_speculative_tokens": 1, "model": "/tmp"}, "model='/tmp' with method='mtp'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model=None with method='draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/tmp"}, "model='/tmp' with method='ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/dir"},
     "model='/no/such/dir' is not a directory"),
    ({"method": "medusa", "num_speculative_tokens": 1}, "method='medusa' is invalid"),
    ({"method": "ngram"}, "num_speculative_tokens=None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 > prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys ['lookahead']"),
    ("ngram", "pass a dict"),
])
def test_bad_config_is_refused_by_name(given, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.from_dict(given)


def test_lookup_bounds_default_as_vllm_does():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)


_arrivals = itertools.count(1)


def _seq(prompt: list[int], max_tokens: int = 50, **params) -> Sequence:
    n = next(_arrivals)
    return Sequence.from_request(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens, **params), n)


def test_drafter_stays_within_max_tokens_the_context_and_the_batch_bound():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 2, "disable_by_batch_size": 3})
    loop = [5, 6, 7, 8, 9] * 3
    a, b, c = _seq(loop), _seq(loop, max_tokens=3), _seq(loop)
    for s in (a, b, c):
        s.token_ids.append(5)          # one output token: the next ones are 6 7 8 9 by lookup
    Drafter(cfg, max_model_len=18).propose([a, b], num_running=2)
    assert a.spec_tokens == [6, 7]     # the context holds 18 tokens: 16 now, so 2 more positions
    assert b.spec_tokens == [6]        # max_tokens 3, one out: two more, the last from the target
    Drafter(cfg, max_model_len=100).propose([c], num_running=3)
    assert c.spec_tokens == []         # disable_by_batch_size reached
    # the drafter's copy of the tokens follows what is appended (here: a new phrase that was seen once before)
    drafter = Drafter(cfg, max_model_len=100)
    drafter.propose([c], num_running=1)
    assert c.spec_tokens == [6, 7, 8, 9]
    c.token_ids += [7, 8, 9, 5, 6, 1, 2, 6]     # "... 5 6 1 2 6": the last 2-gram "2 6" never occurred, "6" after 5
    drafter.propose([c], num_running=1)
    assert c.spec_tokens == [1, 2, 6]


def test_a_draft_chunk_is_scheduled_batched_and_rolled_back():
    sched = Scheduler(BlockPool(16, BS), max_num_seqs=4, max_num_batched_tokens=64)
    seq = _seq([1, 2, 3, 4, 5, 6])
    sched.add(seq)
    out = sched.schedule()
    sched.update(out, [9], EOS, 100)                       # 7 tokens, 6 computed, 2 blocks
    seq.spec_tokens = [10, 11, 12, 13]
    assert sched.max_next_tokens() == 5
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.drafts, s.needs_sample) == (6, 5, [10, 11, 12, 13], True)
    assert len(seq.block_table) == 3                       # positions 6..10 reach block 2
    rows = InputBatch(BS, 16, 100, torch.device("cpu"))
    batch = rows.prepare(order_for_batch(out).scheduled)
    assert batch.input_ids.tolist() == [9, 10, 11, 12, 13] and batch.positions.tolist() == [6, 7, 8, 9, 10]
    assert batch.logit_rows.tolist() == [0, 1, 2, 3, 4]    # every row of the chunk is sampled
    # decode rows, one per token, each seeing the positions up to its own
    assert batch.num_decodes == 5 and batch.prefill is None
    assert batch.decode.context_lens.tolist() == [7, 8, 9, 10, 11]
    assert batch.decode.block_tables.tolist() == [seq.block_table] * 5
    assert_same_as_rebuilt(batch, out)
    # micro-batches never cut the chunk (its rows are all sampled), whatever the split
    parts = split_micro_batches(out.scheduled + [], 3)
    assert sum(len(p) for p in parts) == 1 and max(sum(x.num_new_tokens for x in p) for p in parts) == 5
    free = sched.block_pool.num_free_blocks
    produced = sched.update(out, [[10, 20]], EOS, 100)     # draft 10 accepted, 11 rejected: 20 from the target
    assert produced == [(seq, [10, 20])] and seq.token_ids[-3:] == [9, 10, 20]
    assert seq.num_computed_tokens == 8 and seq.spec_tokens == []   # KV of 9 and 10 kept; 20's is next step's
    assert len(seq.block_table) == 3 and sched.block_pool.num_free_blocks == free
    # a chunk reaching block 3, written into the InputBatch's row, then all its drafts rejected: block 3 goes back
    seq.spec_tokens = [30, 31, 32, 33]
    out = sched.schedule()
    assert len(seq.block_table) == 4
    rows.begin_step()
    rows.prepare(out.scheduled)
    gone = seq.block_table[3]
    sched.update(out, [[40]], EOS, 100)
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3
    # the next chunk reaches block 3 again and gets another block (the freed one waits at the free queue's tail):
    # the row must be rewritten although the table has the width it had when last written
    seq.spec_tokens = [50, 51, 52, 53]
    out = sched.schedule()
    assert len(seq.block_table) == 4 and seq.block_table[3] != gone
    rows.begin_step()
    batch = rows.prepare(out.scheduled)
    assert rows.table_row(seq).tolist()[:4] == seq.block_table
    assert_same_as_rebuilt(batch, out)


@pytest.mark.parametrize("params", [{"stop_token_ids": [10]}, {"max_tokens": 2}])
def test_a_finish_inside_the_accepted_drafts_drops_the_rest_with_prefix_caching_on(params):
    """The target accepts every draft, but the first one ends the request (a stop token, or max_tokens): the tokens
    after it are dropped, and so is their KV, so the blocks the prefix cache takes hold only the tokens kept (the
    accepted chunk reached a block the kept tokens do not fill)."""
    sched = Scheduler(BlockPool(16, BS), max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    seq = _seq([1, 2, 3, 4, 5], **params)
    sched.add(seq)
    sched.update(sched.schedule(), [9], EOS, 100)          # 6 tokens, 5 computed
    seq.spec_tokens = [10, 11, 12]
    out = sched.schedule()
    assert out.scheduled[0].drafts == [10, 11, 12] and len(seq.block_table) == 3   # positions 5..8
    produced = sched.update(out, [[10, 11, 12, 13]], EOS, 100)
    assert produced == [(seq, [10])] and seq.token_ids == [1, 2, 3, 4, 5, 9, 10]
    assert seq.finish_reason == ("stop" if "stop_token_ids" in params else "length")
    assert sched.block_pool.num_free_blocks == 16 and not sched.has_work
    # only block 0 ([1, 2, 3, 4]) is full of kept tokens; the next request finds it, and no more
    again = _seq([1, 2, 3, 4, 5, 9, 10, 11, 12, 13])
    sched.add(again)
    sched.schedule()
    assert sched.num_prefix_hits == BS


def assert_same_as_rebuilt(batch: ForwardBatch, out) -> None:
    want = ForwardBatch.from_scheduled(out.scheduled, BS, torch.device("cpu"))
    for name in ("input_ids", "positions", "slot_mapping", "logit_rows"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert batch.num_decodes == want.num_decodes
    assert torch.equal(batch.decode.context_lens, want.decode.context_lens)


def test_a_draft_chunk_within_a_tight_budget_keeps_what_fits():
    sched = Scheduler(BlockPool(16, BS), max_num_seqs=4, max_num_batched_tokens=3)
    seq = _seq([1, 2])
    sched.add(seq)
    sched.update(sched.schedule(), [9], EOS, 100)
    seq.spec_tokens = [4, 5, 6, 7]
    (s,) = sched.schedule().scheduled
    assert s.num_new_tokens == 3 and s.drafts == [4, 5]


def test_drafts_never_take_blocks_from_other_sequences():
    """4 blocks of 4 tokens: a's drafts would reach a third block, which only preempting b could free (or, for a
    chunk past the pool, none could): the step runs a without its drafts, and b keeps running."""
    sched = Scheduler(BlockPool(4, BS), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq([1, 2, 3, 4, 5, 6, 7]), _seq([1, 2, 3, 4, 5])
    for s in (a, b):
        sched.add(s)
    sched.update(sched.schedule(), [9, 9], EOS, 100)          # a: 8 tokens in 2 blocks, b: 6 in 2
    a.spec_tokens = [1, 2]
    out = sched.schedule()
    assert [(x.seq, x.num_new_tokens, x.drafts) for x in out.scheduled] == [(a, 1, []), (b, 1, [])]
    assert not out.preempted
    sched.update(out, [[5], [5]], EOS, 100)
    sched.abort(b.request_id)                                   # two blocks free now: the drafts fit
    a.spec_tokens = [1, 2]
    (x,) = sched.schedule().scheduled
    assert x.drafts == [1, 2] and x.num_new_tokens == 3


def test_emitted_tokens_follow_the_target_distribution(monkeypatch):
    """6000 random requests with 0, 1 or 2 drafts, vocabulary 4, targets that differ by position: the first two
    tokens emitted fit target_0 x target_1 (chi-square); greedy requests in the same batch get the argmax chain.
    Reading the rows of the wrong request (an off-by-one in the row offsets) fails it."""
    torch.manual_seed(11)
    target = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    n = 6000
    seqs = [_seq([1, 2, 3], temperature=1.0) for _ in range(n)] + [_seq([1, 2, 3]) for _ in range(30)]
    drafts = [[3, 0][:i % 3] for i in range(len(seqs))]
    logits = torch.cat([target[:len(d) + 1].log() for d in drafts])
    reads = []     # the step's one sanctioned read back (comm.sync_audit.host_read); any other read raises

    def host_read(t):
        reads.append(t.shape)
        return torch._C.TensorBase.tolist(t)
    monkeypatch.setattr("attention_nodes.speculation.host_read", host_read)
    with no_host_reads():
        tokens, first_rows = emit(logits, seqs, drafts, EOS)
    assert len(reads) == 1
    assert first_rows == [sum(len(d) + 1 for d in drafts[:i]) for i in range(len(seqs))]
    for t, d in zip(tokens[n:], drafts[n:]):           # greedy: argmax 3, then argmax 0, then argmax 0 or 1 (tie)
        assert t == [3, 0, 0][:len(d) + 1]
    second = torch.multinomial(target[1], n, replacement=True).tolist()
    pairs = torch.tensor([[t[0], t[1] if len(t) > 1 else s] for t, s in zip(tokens[:n], second)])
    expected = target[0].unsqueeze(1) * target[1].unsqueeze(0)
    assert _p_value(pairs, expected) > 1e-3


def test_emitted_tokens_follow_the_tempered_top_k_target():
    """Temperature 0.5 and top_k 3 on the same targets, drafts inside and outside the top 3 (a draft the target
    gives no mass is always rejected): the first two tokens fit the tempered, truncated targets, worked out here
    from their definition (p^(1/T) over the k largest, renormalised)."""
    torch.manual_seed(12)
    target = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    tempered = target ** 2 * (target >= target.sort(dim=1).values[:, 1:2])    # drop each row's smallest
    tempered = tempered / tempered.sum(dim=1, keepdim=True)
    n = 6000
    seqs = [_seq([1, 2, 3], temperature=0.5, top_k=3) for _ in range(n)]
    drafts = [[[3, 0], [0, 3], [2]][i % 3] for i in range(n)]
    logits = torch.cat([target[:len(d) + 1].log() for d in drafts])
    tokens, _ = emit(logits, seqs, drafts, EOS)
    assert all(t[0] != 0 for t in tokens)      # outside position 0's top 3: never emitted, as draft or otherwise
    second = torch.multinomial(tempered[1], n, replacement=True).tolist()
    pairs = torch.tensor([[t[0], t[1] if len(t) > 1 else s] for t, s in zip(tokens, second)])
    expected = (tempered[0].unsqueeze(1) * tempered[1].unsqueeze(0)).flatten().double()
    counts = torch.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0                  # no pair the target gives no mass
    stat = ((counts[kept] - expected[kept] * n) ** 2 / (expected[kept] * n)).sum()
    assert float(torch.special.gammaincc(torch.tensor((int(kept.sum()) - 1) / 2.0), stat / 2)) > 1e-3


def test_seeded_rows_draw_the_same_whatever_the_batch():
    """A seeded request's tokens do not depend on the other requests of its step: their order, or how many drafts
    they carry (a generator that drew one uniform per draft slot of the batch would drift)."""
    base = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))

    def run(order, drafts):
        seqs = [_seq([1, 2, 3], temperature=1.0, seed=s) for s in order]
        for s, seed in zip(seqs, order):
            s.generator = seeded_generator(seed, "cpu")
        logits = torch.cat([base[:len(d) + 1] for d in drafts])
        tokens = emit(logits, seqs, drafts, EOS)[0]
        # a second step from the same generators: what the first step drew decides where they are now
        return dict(zip(order, zip(tokens, emit(logits, seqs, drafts, EOS)[0])))

    alone = run([1], [[7]])
    assert run([3, 1, 2], [[1, 2, 3], [7], []])[1] == alone[1]
    assert run([1, 2], [[7], [4, 5, 6]]) == {**run([2, 1], [[4, 5, 6], [7]])}


def test_counts_add_up_over_ranks():
    a, b = SpecStats(), SpecStats()
    a.add([3, 0, 2], [2, 1, 3])     # accepted 1, -, 2
    b.add([1], [1])                 # accepted 0
    assert summed([a.to_list(), b.to_list(), []]) == {
        "num_drafts": 3, "num_draft_tokens": 6, "num_accepted_tokens": 3, "num_accepted_tokens_per_pos": [2, 1, 0]}


def test_drafts_never_take_the_block_a_later_sequence_needs():
    """Review finding: the oldest sequence's drafts took the last free block that the next sequence's own token
    needed, which then preempted itself (recomputing its whole context) for drafts that may be rejected."""
    pool = BlockPool(3, 4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence.from_request("a", [1, 2, 3], SamplingParams(max_tokens=8), 0)      # its next token fits its block
    b = Sequence.from_request("b", [1, 2, 3, 4], SamplingParams(max_tokens=8), 1)   # its next token needs a block
    for seq in (a, b):
        sched.add(seq)
    sched.update(sched.schedule(), [[5], [5]], frozenset(), 64)
    assert pool.num_free_blocks == 1
    a.spec_tokens = [6, 7, 8]
    out = sched.schedule()
    assert not out.preempted and [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1),
                                                                                                    ("b", 1)]
