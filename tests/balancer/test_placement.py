from __future__ import annotations

import pytest
import torch

from balancer.placement import Placement
from balancer.policy import StaticPolicy, make_policy


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
