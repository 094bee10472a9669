"""Re-placement plans for a changed expert pool: every expert keeps a slot, only arrivals move, and a move
reads the checkpoint only when no surviving rank holds the expert."""
from __future__ import annotations

import torch

from balancer.placement import Placement
from balancer.replan import CHECKPOINT, plan_membership, plan_moves


def _apply(old: torch.Tensor, keep: list[int], new: torch.Tensor, moves) -> torch.Tensor:
    """Carry out moves on "weights" that are the expert ids themselves; CHECKPOINT reads the true id."""
    L, n, S = new.shape
    state = torch.full_like(new, -1)
    for i, k in enumerate(keep):          # a slot whose expert stays keeps its weights (not a move)
        if k >= 0:
            width = min(S, old.shape[2])
            same = old[:, k, :width] == new[:, i, :width]
            state[:, i, :width][same] = new[:, i, :width][same]
    for layer, dst, dslot, src, sslot in moves:
        if src == CHECKPOINT:
            state[layer, dst, dslot] = new[layer, dst, dslot]
        else:
            state[layer, dst, dslot] = old[layer, keep[src], sslot]
    return state


def test_a_lost_rank_is_replaced_from_survivors_and_the_checkpoint():
    old = Placement.identity(num_layers=2, num_experts=8, num_ranks=3)       # [0,1,2] [3,4,5] [6,7,-1]
    keep = [0, 2]                                                          # rank 1 died
    plan = plan_membership(old, keep, redundant_experts=0, rank_node=[0, 0])
    new = plan.placement.slot2expert
    assert new.shape == (2, 2, 4)
    for layer in range(2):
        assert sorted(e for e in new[layer].flatten().tolist() if e >= 0) == list(range(8))
    assert torch.equal(_apply(old.slot2expert, keep, new, plan.moves), new)
    from_ckpt = {(m[0], int(new[m[0], m[1], m[2]])) for m in plan.moves if m[3] == CHECKPOINT}
    assert from_ckpt == {(layer, e) for layer in range(2) for e in (3, 4, 5)}   # exactly the lost experts
    assert plan.num_from_checkpoint == 6
    stays = sum(int(e in old.slot2expert[layer, k].tolist()) for layer in range(2) for i, k in enumerate(keep)
                for e in new[layer, i].tolist() if e >= 0)
    assert len(plan.moves) == int((new >= 0).sum()) - stays                  # only arrivals move


def test_a_joining_rank_gets_its_experts_from_peers():
    old = Placement.identity(num_layers=1, num_experts=8, num_ranks=2)       # [0..3] [4..7]
    keep = [0, 1, -1]
    plan = plan_membership(old, keep, redundant_experts=1, rank_node=[0, 0, 0])
    new = plan.placement.slot2expert
    assert new.shape == (1, 3, 3)
    assert plan.num_from_checkpoint == 0                                     # every expert has a holder
    assert all(m[3] != 2 for m in plan.moves)                                # the new rank holds nothing yet
    assert any(m[1] == 2 for m in plan.moves)
    assert torch.equal(_apply(old.slot2expert, keep, new, plan.moves), new)


def test_plan_moves_with_the_same_ranks_matches_the_old_contract():
    old = torch.tensor([[[0, 1], [2, 3]]])
    new = torch.tensor([[[0, 2], [3, 1]]])
    assert plan_moves(old, new) == [(0, 0, 1, 1, 0), (0, 1, 0, 1, 1), (0, 1, 1, 0, 1)]
