from __future__ import annotations

import numpy as np
import pytest
import torch

from balancer.placement import (
    Placement,
    eplb,
    expert_load,
    load_balance,
    replica_counts,
    slot_capacities,
    stabilize,
)
from balancer.policy import StaticPolicy, make_policy
from balancer.replan import plan_moves


def test_identity_placement_by_hand():
    p = Placement.identity(num_layers=2, num_experts=10, num_ranks=3)
    assert p.num_slots == 4
    assert p.slot2expert[0].tolist() == [[0, 1, 2, 3], [4, 5, 6, -1], [7, 8, 9, -1]]
    log2phy, count = p.log2phy()
    assert log2phy.shape == (2, 10, 1) and count.tolist() == [[1] * 10] * 2
    assert log2phy[1, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10]


def test_static_policy_routes_to_the_only_replica():
    p = Placement.identity(1, 8, 2)
    ids = torch.tensor([[0, 7], [3, 4]])
    phy = StaticPolicy(p).choose(0, ids)
    assert (p.slot2expert[0].view(-1)[phy] == ids).all()


def test_errors_name_values():
    with pytest.raises(ValueError, match=r"expert ranks \(9\) <= num_experts \(8\)"):
        Placement.identity(1, 8, 9)
    with pytest.raises(ValueError, match="balancer 'nope'"):
        make_policy("nope", Placement.identity(1, 8, 2))
    with pytest.raises(ValueError, match="every one of 4 experts"):
        Placement(torch.tensor([[[0, 1], [2, 2]]]), 4)


def test_eplb_by_hand():
    # Loads 6, 3, 2, 1 on 2 ranks x 3 slots (2 redundant). Replicas: expert 0 (6 -> 3 per replica), then
    # expert 1 (3 vs expert 0's 3: tie, but expert 0 already has one replica per rank) -> counts 2, 2, 1, 1.
    # Replicated experts first: 0 -> r0, 0 -> r1, 1 -> r0 (tie: lower rank; r0 = 4.5), 1 -> r1 (4.5, 4.5);
    # then singles heaviest first: 2 -> r0 (6.5), 3 -> r1 (5.5).
    assert replica_counts(np.array([6.0, 3, 2, 1]), 6, max_replicas=2).tolist() == [2, 2, 1, 1]
    p = eplb(torch.tensor([[6.0, 3, 2, 1]]), [3, 3])
    assert p.slot2expert.tolist() == [[[0, 1, 2], [0, 1, 3]]]
    log2phy, count = p.log2phy()
    assert count.tolist() == [[2, 2, 1, 1]] and log2phy[0, 0].tolist() == [0, 3]


@pytest.mark.parametrize("E,n,R", [(16, 4, 4), (64, 8, 16), (60, 7, 13), (8, 8, 8)])
def test_eplb_holds_every_expert_without_duplicates(E, n, R):
    g = torch.Generator().manual_seed(E * n + R)
    load = torch.rand(3, E, generator=g) ** 4 * 1000    # skewed
    cap = slot_capacities(E, R, n)
    p = eplb(load, cap)
    for layer in range(3):
        for r in range(n):
            held = [e for e in p.slot2expert[layer, r].tolist() if e >= 0]
            assert len(held) == cap[r] and len(set(held)) == len(held)
        assert sorted(set(p.slot2expert[layer].flatten().tolist()) - {-1}) == list(range(E))
    # the heaviest expert of each layer is replicated
    _, count = p.log2phy()
    assert all(count[layer, int(load[layer].argmax())] > 1 for layer in range(3))


def test_duplicates_only_when_a_rank_has_more_slots_than_experts():
    p = eplb(torch.tensor([[5.0, 1.0]]), [3, 3])         # 3 slots per rank, 2 experts: unavoidable
    assert sorted(p.slot2expert[0, 0].tolist()) in ([0, 0, 1], [0, 1, 1])


def test_eplb_balances_expected_load():
    g = torch.Generator().manual_seed(3)
    load = torch.rand(1, 64, generator=g) ** 3 * 100
    p = eplb(load, slot_capacities(64, 16, 8))
    log2phy, count = p.log2phy()
    per = (load[0] / count[0]).double()
    rank_load = torch.zeros(8, dtype=torch.float64)
    for e in range(64):
        for j in range(int(count[0, e])):
            rank_load[int(log2phy[0, e, j]) // p.num_slots] += per[e]
    assert float(rank_load.max() / rank_load.mean()) < 1.05


def test_hierarchical_packs_nodes_then_ranks():
    g = torch.Generator().manual_seed(4)
    load = torch.rand(2, 32, generator=g) ** 3 * 100
    cap = slot_capacities(32, 8, 4)
    p = eplb(load, cap, rank_node=[0, 0, 1, 1])
    log2phy, count = p.log2phy()
    for layer in range(2):
        node_load = [0.0, 0.0]
        for e in range(32):
            for j in range(int(count[layer, e])):
                node_load[int(log2phy[layer, e, j]) // p.num_slots // 2] += float(load[layer, e] / count[layer, e])
        assert max(node_load) / (sum(node_load) / 2) < 1.1
        for r in range(4):
            held = [e for e in p.slot2expert[layer, r].tolist() if e >= 0]
            assert len(set(held)) == len(held) == cap[r]


def test_stabilize_and_moves_turn_old_into_new():
    g = torch.Generator().manual_seed(5)
    cap = slot_capacities(12, 4, 4)
    old = eplb(torch.ones(2, 12), cap).slot2expert
    new = stabilize(old, eplb(torch.rand(2, 12, generator=g) * 10, cap).slot2expert)
    moves = plan_moves(old, new)
    # simulate: each slot holds "the weights of" its expert; apply the copies reading the old state
    state = old.clone()
    for layer, dst, dslot, src, sslot in moves:
        state[layer, dst, dslot] = old[layer, src, sslot]
    assert torch.equal(state, new)
    stays = sum(int(e >= 0 and e in old[layer, r].tolist()) for layer in range(2) for r in range(4)
                for e in new[layer, r].tolist())
    assert len(moves) == int((new >= 0).sum()) - stays     # only arrivals move


def test_expert_load_and_balance_by_hand():
    s2e = torch.tensor([[[0, 1], [0, 2]]])            # expert 0 on both ranks
    counts = torch.tensor([[[5, 1], [3, 7]]])
    assert expert_load(s2e, counts, 3).tolist() == [[8.0, 1.0, 7.0]]
    # rank loads per step: step 0 (6, 10) -> 10/8; step 1 (0, 0) skipped; step 2 (4, 4) -> 1
    steps = torch.tensor([[[6], [0], [4]], [[10], [0], [4]]])
    assert load_balance(steps) == [pytest.approx((10 / 8 + 1) / 2)]


def test_slot_capacity_errors_name_values():
    with pytest.raises(ValueError, match="redundant_experts=-1"):
        slot_capacities(8, -1, 2)
    assert slot_capacities(10, 0, 3) == [4, 3, 3]
