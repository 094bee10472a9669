"""Topology's node arithmetic: consecutive blocks of ranks_per_node at start-up, or the node each rank names
after a re-forming (which ProcessGroups.create and two_phase's gateways build on)."""
from __future__ import annotations

import pytest

from comm.topology import Topology


def test_consecutive_blocks():
    topo = Topology(3, 5, 2, ranks_per_node=2)
    assert topo.rank_nodes() == [0, 0, 1, 1, 2]
    assert [topo.local_index(r) for r in range(5)] == [0, 1, 0, 1, 0]
    assert topo.num_nodes == 3 and topo.node_ids == [0, 1, 2]


def test_nodes_named_per_rank():
    """5 ranks on nodes 3, 1, 1, 3, 5 (labels kept from the first generation, out of order): each rank's place
    on its node counts the ranks before it there; a node that lost every rank is simply absent."""
    topo = Topology(2, 5, 2, ranks_per_node=2, nodes=[3, 1, 1, 3, 5])
    assert topo.node_of(0) == 3 and topo.node_of(4) == 5
    assert [topo.local_index(r) for r in range(5)] == [0, 0, 1, 1, 0]
    assert topo.num_nodes == 3 and topo.node_ids == [1, 3, 5]


def test_a_node_list_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="nodes of 4 ranks in a world of 5"):
        Topology(0, 5, 2, ranks_per_node=2, nodes=[0, 0, 1, 1])


def _form(rank: int, world: int) -> list[tuple[int, int]]:
    """ProcessGroups.form on 2 attention + 1 expert ranks over gloo -> the sizes of the groups of the all_reduce
    calls it makes on this rank, in order."""
    import os

    import torch.distributed as dist

    from comm.topology import ProcessGroups
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, group=None, **kw: calls.append(dist.get_world_size(group)) or real(
        t, *a, group=group, **kw)
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0)
    groups = ProcessGroups.form(store, Topology(rank, world, 2, ranks_per_node=world), "gloo", "cpu", 60, 60)
    assert (groups.attention_data is None) == (rank == 2)
    return calls


def test_forming_runs_a_first_collective_of_each_data_group_with_every_member():
    """NCCL's batched point-to-point lets part of a group take part only after a first collective of the whole
    group: form() makes it, on the world (all three ranks) and on the attention ranks' data group."""
    from tests.dist_utils import run_ranks
    assert run_ranks(_form, 3) == [[3, 2], [3, 2], [3]]
