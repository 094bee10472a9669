from __future__ import annotations

import pytest

from comm.control import StepHeader, StepReport, pack, unpack
from comm.topology import Topology


def test_header_and_report_roundtrip_msgpack():
    h = StepHeader("step", 7, 64, {"1": [{"id": "a", "prompt": [1, 2], "params": {"max_tokens": 3}}]}, {"0": ["b"]})
    back = StepHeader(**unpack(pack(h)))
    assert back == h and back.requests_for(1)[0]["prompt"] == [1, 2] and back.aborts_for(0) == ["b"]
    r = StepReport(1, 10, 2, 3, 64, 4, 5, [["a", [9], None]])
    assert StepReport(**unpack(pack(r))) == r


def test_topology_roles_and_nodes():
    t = Topology(rank=5, world_size=8, num_attention_ranks=3, ranks_per_node=4)
    assert t.role == "expert" and t.expert_index == 2 and t.num_nodes == 2
    assert t.node_of(5) == 1 and t.local_index(5) == 1
    with pytest.raises(ValueError, match="attention_ranks=0"):
        Topology(0, 2, 0, 1)
    with pytest.raises(ValueError, match="leaves 0 expert ranks"):
        Topology(0, 2, 2, 1)


def test_large_header_crosses_in_two_broadcasts():
    from comm.control import HEADER_BYTES
    from tests.dist_utils import run_ranks
    aborts = {"1": [f"request-{i:06d}" for i in range(400)]}
    assert pack(StepHeader("step", 1, 512, {}, aborts)).numel() > HEADER_BYTES
    got = run_ranks(_broadcast_fn, 3, StepHeader("step", 1, 512, {}, aborts))
    assert all(h == StepHeader("step", 1, 512, {}, aborts) for h in got)


def test_prompts_reach_only_the_rank_that_owns_them():
    """Ranks 0 and 1 get new requests, rank 2 (an expert rank, say) none: the broadcast carries no prompt,
    rank 1 receives its own requests only, rank 2 none; the leader keeps the whole header."""
    from tests.dist_utils import run_ranks
    new = {"0": [{"id": "a", "prompt": list(range(300)), "params": {}}],
           "1": [{"id": f"b{i}", "prompt": [7] * 50, "params": {"max_tokens": 2}} for i in range(3)]}
    header = StepHeader("step", 4, 512, new, {"1": ["c"]}, micro_batches=2)
    leader, one, two = run_ranks(_broadcast_fn, 3, header)
    assert leader == header
    assert one.new_requests == {"1": new["1"]} and one.request_ranks == [0, 1]
    assert two.new_requests == {} and two.request_ranks == [0, 1]
    for h in (one, two):     # everything else crosses as it was
        assert (h.kind, h.step, h.capacity, h.aborts, h.micro_batches) == ("step", 4, 512, {"1": ["c"]}, 2)


def _broadcast_fn(rank, world, header):
    import torch.distributed as dist

    from comm.control import ControlPlane
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp = ControlPlane(dist.group.WORLD, None, rank, 1)
    small = cp.broadcast_header(StepHeader("idle", 0) if rank == 0 else None)
    assert small == StepHeader("idle", 0)
    return cp.broadcast_header(header if rank == 0 else None)


@pytest.mark.parametrize("big", [False, True])
def test_reports_reach_the_leader_in_one_collective_unless_one_overflows(big):
    """Three attention ranks' reports (rank 1's larger than a gather slot when big): the leader gets each exactly,
    in rank order, the others None; one collective, two when a report overflows its slot."""
    from comm.control import GATHER_BYTES
    from tests.dist_utils import run_ranks
    got = run_ranks(_gather_fn, 3, big)
    expected = [_report(r, big) for r in range(3)]
    assert (pack(expected[1]).numel() > GATHER_BYTES) == big
    assert got[0]["reports"] == expected and got[1]["reports"] is got[2]["reports"] is None
    assert all(g["collectives"] == (2 if big else 1) for g in got)


def _report(rank: int, big: bool) -> StepReport:
    n = 3000 if big and rank == 1 else 3 + rank
    return StepReport(rank, 100 - rank, n, 0, outputs=[[f"r{rank}-{i}", [i, i + 1], None, None, None]
                                                      for i in range(n)])


def _gather_fn(rank, world, big):
    import torch.distributed as dist

    from comm.control import ControlPlane
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp = ControlPlane(dist.group.WORLD, dist.group.WORLD, rank, world)
    calls = []
    real = {name: getattr(dist, name) for name in ("all_gather", "gather", "broadcast", "all_reduce")}

    def counting(f):
        def call(*args, **kwargs):
            calls.append(f.__name__)
            return f(*args, **kwargs)
        return call

    for name, f in real.items():
        setattr(dist, name, counting(f))
    try:
        reports = cp.gather_reports(_report(rank, big))
    finally:
        for name, f in real.items():
            setattr(dist, name, f)
    return {"reports": reports, "collectives": len(calls)}
