from __future__ import annotations

from attention_nodes.batch import split_micro_batches
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.sequence import Sequence
from attention_nodes.step_plan import ScheduledSeq


def make_scheduled(sizes: list[int]) -> list[ScheduledSeq]:
    out = []
    for i, n in enumerate(sizes):
        seq = Sequence.from_request(str(i), [1] * n, SamplingParams(), i + 1)
        out.append(ScheduledSeq.from_seq(seq, n))
    return out


def pieces(parts):
    return [[(s.seq.request_id, s.start, s.num_new_tokens) for s in p] for p in parts]


def test_split_keeps_order_and_cuts_the_straddling_chunk():
    sched = make_scheduled([1, 1, 1, 1, 8, 4])
    parts = split_micro_batches(sched, 2)
    assert pieces(parts) == [[("0", 0, 1), ("1", 0, 1), ("2", 0, 1), ("3", 0, 1), ("4", 0, 4)],
                             [("4", 4, 4), ("5", 0, 4)]]
    first, second = parts[0][-1], parts[1][0]
    assert first.seq is second.seq is sched[4].seq
    assert not first.needs_sample and second.needs_sample       # only the piece that reaches the end samples
    assert split_micro_batches(sched, 1) == [sched]


def test_a_long_chunk_after_decodes_is_shared_out():
    """63 decodes and a 255-token prompt chunk (a step of the throughput workload): each micro-batch gets 159
    tokens, where whole chunks would put the chunk alone in the second."""
    parts = split_micro_batches(make_scheduled([1] * 63 + [255]), 2)
    assert [sum(s.num_new_tokens for s in p) for p in parts] == [159, 159]
    assert pieces(parts)[0][-1] == ("63", 0, 96) and pieces(parts)[1] == [("63", 96, 159)]
    three = split_micro_batches(make_scheduled([5]), 3)
    assert pieces(three) == [[("0", 0, 1)], [("0", 1, 2)], [("0", 3, 2)]]


def test_single_token_rows_are_never_cut():
    parts = split_micro_batches(make_scheduled([1, 1, 1]), 2)
    assert [len(p) for p in parts] == [1, 2] and all(s.num_new_tokens == 1 for p in parts for s in p)


def test_split_of_tiny_batches_leaves_empty_parts():
    assert sorted(len(p) for p in split_micro_batches(make_scheduled([1]), 2)) == [0, 1]
    assert split_micro_batches([], 3) == [[], [], []]
