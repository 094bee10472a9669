from __future__ import annotations

from attention_nodes.batch import split_micro_batches
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import ScheduledSeq
from attention_nodes.sequence import Sequence


def make_scheduled(sizes: list[int]) -> list[ScheduledSeq]:
    out = []
    for i, n in enumerate(sizes):
        seq = Sequence.from_request(str(i), [1] * n, SamplingParams(), i + 1)
        out.append(ScheduledSeq.from_seq(seq, n))
    return out


def test_split_keeps_order_and_balances_tokens():
    sched = make_scheduled([1, 1, 1, 1, 8, 4])
    parts = split_micro_batches(sched, 2)
    assert [s for p in parts for s in p] == sched
    assert [sum(s.num_new_tokens for s in p) for p in parts] == [4, 12]
    assert split_micro_batches(sched, 1) == [sched]


def test_split_of_tiny_batches_leaves_empty_parts():
    assert sorted(len(p) for p in split_micro_batches(make_scheduled([1]), 2)) == [0, 1]
    assert split_micro_batches([], 3) == [[], [], []]
