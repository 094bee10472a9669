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
    return StepReport(rank, 100 - rank, n, 0, outputs=[[f"r{rank}-{i}", [i, i + 1], None, None, None, 0]
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


def test_headers_sent_to_settle_later_arrive_in_order_among_other_exchanges():
    """The leader's step headers with settle_later (the broadcast still going out when the call returns) reach
    every rank in order, interleaved with a header carrying requests (sent at once, with its requests), one
    too large for a buffer (two broadcasts), report gathers and an object gather."""
    from tests.dist_utils import run_ranks
    got = run_ranks(_settle_later_fn, 3)
    leader, one, two = got
    headers = _settle_later_headers()
    assert leader["headers"] == headers
    for rank, g in ((1, one), (2, two)):
        assert [h.step for h in g["headers"]] == [h.step for h in headers]
        assert [h.aborts for h in g["headers"]] == [h.aborts for h in headers]
        assert [h.requests_for(rank) for h in g["headers"]] == [h.requests_for(rank) for h in headers]
    assert leader["reports"] == [[StepReport(r, s, 0, 0) for r in range(2)] for s in (1, 2, 4)]
    assert leader["objects"] == [[0, 10, 20]]


def _settle_later_headers() -> list[StepHeader]:
    big = {"2": [f"request-{i:06d}" for i in range(400)]}
    new = {"1": [{"id": "a", "prompt": [5] * 40, "params": {}}]}
    return [StepHeader("step", 1, 64), StepHeader("step", 2, 512, new), StepHeader("step", 3, 64, {}, big),
            StepHeader("step", 4, 64)]


def _settle_later_fn(rank, world):
    import torch.distributed as dist

    from comm.control import ControlPlane
    dist.init_process_group("gloo", rank=rank, world_size=world)
    attention = dist.new_group([0, 1])
    cp = ControlPlane(dist.group.WORLD, attention if rank < 2 else None, rank, 2)
    out = {"headers": [], "reports": [], "objects": []}
    for h in _settle_later_headers():
        got = cp.broadcast_header(h if rank == 0 else None, settle_later=rank == 0)
        out["headers"].append(got)
        if h.step != 3 and rank < 2:
            out["reports"].append(cp.gather_reports(StepReport(rank, h.step, 0, 0)))
    out["objects"].append(cp.gather_objects(10 * rank))
    out["reports"] = [r for r in out["reports"] if r is not None]
    return out
