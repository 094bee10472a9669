"""balancer/drift.py: the change detector's predicted imbalance, and incremental re-placement that gives the
hottest expert (by load per replica) replicas in the slots that cost least, a bounded number of slots at a time."""
from __future__ import annotations

import torch

from balancer.drift import imbalance, incremental_replan
from balancer.placement import Placement


def _placement(rows: list[list[int]], num_experts: int) -> Placement:
    return Placement(torch.tensor([rows]), num_experts)


def test_the_predicted_imbalance_splits_each_experts_load_over_its_replicas():
    """Ranks [0, 1], [2, 1], [3, -1]: expert 1 on two ranks. Loads 6, 4, 2, 2: rank loads 6+2, 2+2, 2; mean 4."""
    p = _placement([[0, 1], [2, 1], [3, -1]], 4)
    assert imbalance(p, torch.tensor([[6.0, 4.0, 2.0, 2.0]])) == [8 / (14 / 3)]
    assert imbalance(p, torch.zeros(1, 4)) == [1.0]


def test_the_hot_expert_takes_the_slot_that_costs_least_and_the_copy_comes_from_its_rank():
    """Ranks [0, 1], [1, 2], [2, 3], [3, 4]; loads 90, 4, 6, 2, 1. Expert 0 (90 on one replica) takes, first, a
    slot of expert 3 (giving one up leaves it 2 per replica, against 4 for expert 1 and 6 for expert 2), the one
    on the lighter rank 3; then, with expert 3 down to one replica, a slot of expert 1 on rank 1. Each copy comes
    from rank 0, slot 0. Every expert stays placed."""
    p = _placement([[0, 1], [1, 2], [2, 3], [3, 4]], 5)
    load = torch.tensor([[90.0, 4.0, 6.0, 2.0, 1.0]])
    one = incremental_replan(p, load, 1, [2, 2, 2, 2])
    assert one.placement.slot2expert[0].tolist() == [[0, 1], [1, 2], [2, 3], [0, 4]]
    assert one.moves == [(0, 3, 0, 0, 0)]
    two = incremental_replan(p, load, 2, [2, 2, 2, 2])
    assert two.placement.slot2expert[0].tolist() == [[0, 1], [0, 2], [2, 3], [0, 4]]
    assert sorted(two.moves) == [(0, 1, 0, 0, 0), (0, 3, 0, 0, 0)]


def test_a_balanced_placement_moves_nothing_and_the_moves_stay_within_the_bound():
    """Equal loads on one replica each: no move lowers the highest load per replica. A skewed load with a bound
    of 2 moves at most 2 slots per layer."""
    p = Placement(torch.tensor([[[0, 1], [2, 3]], [[3, 2], [1, 0]]]), 4)
    assert incremental_replan(p, torch.ones(2, 4), 8, [2, 2]).moves == []
    q = Placement(torch.tensor([[[0, 1, 2], [3, 4, 5], [6, 7, 1]]]), 8)
    skewed = torch.tensor([[50.0, 1.0, 30.0, 20.0, 1.0, 1.0, 1.0, 1.0]])
    replan = incremental_replan(q, skewed, 2, [3, 3, 3])
    assert len(replan.moves) <= 2 and set(replan.placement.slot2expert.flatten().tolist()) == set(range(8))


def test_a_ranks_padding_slot_stays_empty_and_an_only_replica_is_never_taken():
    """8 experts on 3 ranks without redundant slots: capacities 3, 3, 2, the third rank's last slot is padding.
    However hot expert 0 is, no slot may take a replica of it: the padding slot is not the rank's, and every
    other slot holds an expert's only replica. With one redundant slot (capacities 3, 3, 3) it goes there."""
    p = Placement.identity(1, 8, 3)
    assert p.slot2expert[0].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, -1]]
    hot = torch.tensor([[100.0] + [1.0] * 7])
    assert incremental_replan(p, hot, 4, [3, 3, 2]).moves == []
    replan = incremental_replan(p, hot, 4, [3, 3, 3])
    assert replan.placement.slot2expert[0].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]
