"""LoadTracker: the counts an expert rank reports, against a count written out here; the ring of per-step loads
keeps the last `history` steps oldest first; what it hands out is a host copy; and add/end_step read nothing on
the host."""
from __future__ import annotations

import torch

from balancer.load import LoadTracker
from tests.host_reads import no_host_reads

L, S = 3, 5


def received_slots(seed: int, rows: int, top_k: int = 4) -> torch.Tensor:
    """`[rows, top_k]` slots, about a third -1 (the pair went to another rank)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, S, (rows, top_k), generator=g) * (torch.rand(rows, top_k, generator=g) > 0.2)


def count(slots: torch.Tensor) -> list[int]:
    flat = slots.flatten().tolist()
    return [sum(1 for s in flat if s == slot) for slot in range(S)]


def test_counts_and_step_loads_match_a_count_written_out():
    tracker = LoadTracker(L, S, history=3)
    want_slots = [[0] * S for _ in range(L)]
    want_steps = []
    for step in range(5):
        per_layer = [0] * L
        for layer in range(L):
            for micro_batch in range(2):
                slots = received_slots(100 * step + 10 * layer + micro_batch, rows=7 + step)
                tracker.add(layer, slots)
                c = count(slots)
                want_slots[layer] = [a + b for a, b in zip(want_slots[layer], c)]
                per_layer[layer] += sum(c)
        tracker.end_step()
        want_steps.append(per_layer)
        loads = tracker.step_loads()
        assert loads.tolist() == want_steps[-3:]              # the last `history` steps, oldest first
    taken = tracker.take_slot_counts()
    assert taken.tolist() == want_slots and taken.device.type == "cpu"
    assert tracker.take_slot_counts().tolist() == [[0] * S] * L   # taking resets
    tracker.add(0, torch.zeros(0, 4, dtype=torch.int64))        # a layer with no rows
    tracker.end_step()
    assert tracker.step_loads().tolist() == want_steps[-2:] + [[0] * L]


def test_what_it_hands_out_is_a_copy():
    tracker = LoadTracker(1, S)
    assert tracker.step_loads().shape == (0, 1)
    tracker.add(0, torch.tensor([[1, 1, -1]]))
    tracker.end_step()
    loads = tracker.step_loads()
    loads.zero_()
    assert tracker.step_loads().tolist() == [[2]]


def test_add_and_end_step_read_nothing_on_the_host():
    tracker = LoadTracker(L, S)
    slots = received_slots(0, rows=9)
    with no_host_reads():
        for layer in range(L):
            tracker.add(layer, slots)
        tracker.end_step()
    assert tracker.take_slot_counts()[1].tolist() == count(slots)
    assert tracker.step_loads().tolist() == [[sum(count(slots))] * L]
