"""The plan of a generation (launch/runtime/planning.py), as a pure function: no ranks, no model. Expected
values are stated from the placement itself (which experts the lost rank held), not from the plan."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from balancer.placement import Placement, eplb, slot_capacities
from balancer.policy import LeastLoadedPolicy
from launch.runtime.handoff import side_moves
from launch.runtime.planning import (Job, MembershipError, check_scale, grown_ranks_per_node, joiner_refusal,
                                     placement_of, plan_generation, plan_handover)

L, E = 2, 8
BIG = {"expert_budget": 2**40}


def make_job(num_attention: int = 1, num_expert: int = 3, **kw) -> Job:
    members = list(range(num_attention + num_expert))
    placement = Placement.identity(L, E, num_expert)
    return Job(members, num_attention, ranks_per_node=kw.get("ranks_per_node", len(members)), placement=placement,
               load_ema=None, num_experts=E, num_moe_layers=L, redundant_experts=0,
               bytes_per_slot=kw.get("bytes_per_slot", 1), nodes=kw.get("nodes"),
               prefill_ranks=kw.get("prefill_ranks", 0), pd=kw.get("pd", kw.get("prefill_ranks", 0) > 0))


def held(job: Job, expert_index: int) -> set[int]:
    row = job.placement.slot2expert[0, expert_index]
    return {int(e) for e in row if e >= 0}


def test_a_dead_expert_rank_is_left_out_and_only_its_experts_come_from_the_checkpoint():
    job = make_job()
    dead = 2                                     # member 2 = expert index 1 (world rank 2)
    infos = {m: BIG for m in job.members if m != dead}
    plan = plan_generation(job, 1, infos, [dead])
    assert plan["members"] == [0, 1, 3]
    assert plan["keep"] == [0, 2] and plan["attention_keep"] == [0]
    new = torch.tensor(plan["slot2expert"])
    for layer in range(L):                       # every expert still has a slot
        assert set(new[layer].flatten().tolist()) - {-1} == set(range(E))
    assert plan["from_checkpoint"] == L * len(held(job, 1))
    assert plan["staged"] == []                  # a dead rank cannot send


def test_a_retiring_expert_rank_sends_the_experts_only_it_holds():
    job = make_job()
    plan = plan_generation(job, 1, {m: BIG for m in job.members}, [2], retiring=True)
    assert plan["from_checkpoint"] == 0
    assert len(plan["staged"]) == L * len(held(job, 1))
    for layer, dst, _, donor, donor_slot in plan["staged"]:
        assert donor == 1 and dst in (0, 2)
        assert int(job.placement.slot2expert[layer, donor, donor_slot]) in held(job, 1)


def test_a_change_that_retires_and_adds_expert_ranks_hands_the_joiners_the_retiring_ranks_experts():
    """1 + 3 expert ranks; expert rank 1 (member 2) retires and member 10 joins. Every expert that only the
    retiring rank holds goes from it: to a staying rank in the old generation (staged) or to the joiner over a
    side group (handoff, in the joiner's new index); none is read from the checkpoint."""
    job = make_job()
    joined = [(10, {"role": "expert", "expert_budget": 2**40})]
    plan = plan_generation(job, 1, {m: BIG for m in job.members}, [2], joined, retiring=True)
    assert plan["members"] == [0, 1, 3, 10] and plan["keep"] == [0, 2, -1]
    new = torch.tensor(plan["slot2expert"])
    assert plan["handoff"] and plan["from_checkpoint"] == 0
    for layer, joiner, slot, donor, donor_slot in plan["handoff"]:
        assert joiner == 2 and donor == 1                           # the joiner is new expert index 2
        assert int(new[layer, joiner, slot]) == int(job.placement.slot2expert[layer, donor, donor_slot])
    moved = {(m[0], int(job.placement.slot2expert[m[0], m[3], m[4]])) for m in plan["staged"] + plan["handoff"]}
    retiring_only = {(layer, e) for layer in range(L) for e in held(job, 1)}
    assert moved == retiring_only
    assert side_moves(plan["handoff"]) == [(layer, 1, slot, 0, ds) for layer, _, slot, _, ds in plan["handoff"]]


def test_joiners_come_after_the_kept_ranks_of_their_role():
    job = make_job(num_attention=2, num_expert=2)
    joined = [(10, {"role": "expert", "expert_budget": 2**40}), (11, {"role": "attention", "kv_blocks": 7})]
    plan = plan_generation(job, 1, {m: BIG for m in job.members}, [], joined)
    assert plan["members"] == [0, 1, 11, 2, 3, 10]
    assert plan["attention_keep"] == [0, 1, -1] and plan["keep"] == [0, 1, -1]
    assert plan["kv_blocks"] == [7] and plan["joined"] == [10, 11]


def test_every_member_adopts_the_load_the_plan_placed_for():
    """A joining attention rank has no load of its own: it builds its least_loaded tables from the plan's, which are
    then the kept ranks' (it built them from no load, and the replicas' shares differed between ranks). With the
    expert pool unchanged the placement and its load stay; losing an expert rank re-places for the load EMA."""
    g = torch.Generator().manual_seed(3)
    placed_for, ema = torch.rand(L, E, generator=g, dtype=torch.float64) + 0.1, torch.rand(L, E, generator=g) + 0.1
    job = make_job(num_attention=1, num_expert=3)
    job.placement, job.load_ema, job.redundant_experts = eplb(placed_for, slot_capacities(E, 4, 3)), ema, 4
    joined = plan_generation(job, 1, {m: BIG for m in job.members}, [], [(11, {"role": "attention", "kv_blocks": 7})])
    adopted = placement_of(msgpack.unpackb(msgpack.packb(joined), strict_map_key=False), E)
    assert torch.equal(adopted.slot2expert, job.placement.slot2expert) and torch.equal(adopted.load, placed_for)
    kept, joiner = LeastLoadedPolicy(job.placement), LeastLoadedPolicy(adopted)
    assert all(torch.equal(getattr(k, f.name), getattr(j, f.name))
               for k, j in zip(kept.tables, joiner.tables) for f in dataclasses.fields(k))
    lost = placement_of(plan_generation(job, 1, {m: BIG for m in job.members}, [3]), E)
    assert torch.equal(lost.load, ema.to(torch.float64))
    assert placement_of(plan_generation(make_job(), 1, {m: BIG for m in range(4)}, [], []), E).load is None


def test_members_stay_on_their_nodes_when_the_job_re_forms():
    """3 + 3 ranks in nodes of 2 (0 1 | 2 3 | 4 5; ranks 0-2 attention). Attention rank 1 dies: the ranks after it
    are renumbered but stay on their nodes, 0 | 1 2 | 3 4 (consecutive blocks would have put old rank 2, on node
    1, with rank 0 on node 0, and old rank 4 with old rank 3). An attention rank then joins: node 0 has room.
    Losing the last rank leaves consecutive blocks, said as None; a joiner with no room opens a node."""
    job = make_job(num_attention=3, num_expert=3, ranks_per_node=2)
    plan = plan_generation(job, 1, {m: BIG for m in job.members}, [1])
    assert plan["members"] == [0, 2, 3, 4, 5] and plan["nodes"] == [0, 1, 1, 2, 2]
    after = make_job(num_attention=2, num_expert=3, ranks_per_node=2, nodes=plan["nodes"])
    after.members = plan["members"]
    plan = plan_generation(after, 2, {m: BIG for m in after.members}, [], [(9, {"role": "attention"})])
    assert plan["members"] == [0, 2, 9, 3, 4, 5] and plan["nodes"] == [0, 1, 0, 1, 2, 2]
    assert plan_generation(job, 1, {m: BIG for m in job.members}, [5])["nodes"] is None
    full = make_job(num_attention=2, num_expert=2, ranks_per_node=2)
    grown = plan_generation(full, 1, {m: BIG for m in full.members}, [], [(9, {"role": "attention"})])
    assert grown["members"] == [0, 1, 9, 2, 3] and grown["nodes"] == [0, 0, 2, 1, 1]


def test_too_little_expert_memory_names_the_rank_and_the_way_out():
    job = make_job(bytes_per_slot=1 << 20)
    infos = {m: {"expert_budget": 1 << 20} for m in job.members}   # one slot's worth; 4 are needed after a loss
    with pytest.raises(MembershipError, match=r"expert rank 1 \(now 1\) would need 4.0 MiB.*expert_memory"):
        plan_generation(job, 1, infos, [2])


def test_losing_every_expert_rank_ends_the_job():
    job = make_job(num_expert=1)
    with pytest.raises(MembershipError, match="every expert rank died"):
        plan_generation(job, 1, {}, [1])


def test_a_one_node_job_stays_one_node_as_it_grows():
    """Spawned ranks (3 on one host, node size not configured) grown to 6: still one node, so shm/cuda_ipc
    still carry it (a grown job counted a second node on an H100 and refused cuda_ipc). A configured node size
    and a job of several nodes keep theirs; shrinking never splits a node."""
    assert grown_ranks_per_node(3, False, 1, 6) == 6
    assert grown_ranks_per_node(3, False, 1, 2) == 3
    assert grown_ranks_per_node(2, True, 1, 4) == 2       # ranks_per_node=2 asked for: emulated nodes of 2
    assert grown_ranks_per_node(4, False, 2, 12) == 4     # torchrun on two nodes of 4


def test_a_retiring_attention_ranks_requests_go_to_a_pool_that_can_hold_them():
    """The handover's taker, worked by hand. Rank 1 (pool 100, 60 free) retires; rank 2 has the most free blocks
    (80) but a pool of 80, smaller than rank 1's: a sequence of 90 blocks that ran on rank 1 could never run
    there. Rank 0 (pool 200, 50 free) and rank 3 (pool 100, 30 free) can hold anything rank 1 held: rank 0,
    the one with more free. With rank 3 retiring too, rank 0 is charged rank 1's 40 used blocks (10 free left)
    and still takes rank 3's: rank 2's pool is smaller than rank 3's. With every staying pool smaller than the
    leaving one's, the largest takes them; among equal pools, the most free."""
    blocks = [(50, 200), (60, 100), (80, 80), (30, 100)]
    assert plan_handover(blocks, [1]) == {"1": 0}
    assert plan_handover(blocks, [1, 3]) == {"1": 0, "3": 0}
    assert plan_handover([(10, 50), (5, 100), (40, 60)], [1]) == {"1": 2}
    assert plan_handover([(90, 100), (5, 100), (40, 100)], [1]) == {"1": 0}   # equal pools: most free
    assert plan_handover(blocks, [1, 5]) == {"1": 0}   # rank 5, an expert rank, retires too: it hands nothing over
    assert plan_handover(blocks, [4]) == {}


def test_pd_roles_stay_positional_as_ranks_join_and_leave():
    """PD's prefill ranks are the first prefill_ranks, so a plan puts prefill joiners after the kept prefill ranks
    and decode joiners after the kept decode ranks. Job: attention members 0, 1 (prefill), 2, 3 (decode), experts
    4-6. Member 1 retires, member 9 joins as prefill, 10 as attention (the prefill pool: the leader's launch's
    role), 8 as decode, 7 as an expert."""
    job = make_job(4, 3, prefill_ranks=2)
    joined = [(8, {"role": "decode", "kv_blocks": 80}), (9, {"role": "prefill", "kv_blocks": 90}),
              (7, {"role": "expert", **BIG}), (10, {"role": "attention", "kv_blocks": 100})]
    plan = plan_generation(job, 1, {m: BIG for m in job.members}, [1], joined, retiring=True)
    assert plan["attention_keep"] == [0, -1, -1, 2, 3, -1] and plan["prefill_ranks"] == 3
    assert plan["members"] == [0, 9, 10, 2, 3, 8, 4, 5, 6, 7]
    assert plan["kv_blocks"] == [90, 100, 80]            # the joiners' pools, in their new order
    # the decode ranks retire: no decode rank is left, the job runs colocated
    assert plan_generation(job, 1, {m: BIG for m in job.members}, [2, 3], retiring=True)["prefill_ranks"] == 0
    # ... and once a decode rank joins such a job again, every rank it kept prefills
    gone = make_job(2, 3, prefill_ranks=0, pd=True)
    plan = plan_generation(gone, 1, {m: BIG for m in gone.members}, [], [(9, {"role": "decode"})])
    assert plan["attention_keep"] == [0, 1, -1] and plan["prefill_ranks"] == 2
    # without PD: an attention or decode joiner is an attention rank; a prefill joiner is refused by name
    plain = make_job(2, 3)
    plan = plan_generation(plain, 1, {m: BIG for m in plain.members}, [], [(9, {"role": "decode"})])
    assert plan["attention_keep"] == [0, 1, -1] and plan["prefill_ranks"] == 0
    with pytest.raises(MembershipError, match="member 9 joins as a prefill rank.*--prefill-ranks"):
        plan_generation(plain, 1, {m: BIG for m in plain.members}, [], [(9, {"role": "prefill"})])


def test_with_pd_a_retiring_rank_hands_over_to_a_rank_of_its_role():
    """Ranks 0, 1 prefill, 2, 3 decode. Rank 2 has the most free blocks of all, but a retiring prefill rank's
    unfinished prompts go to the other prefill rank; a retiring decode rank's requests go to the other decode
    rank even though rank 0 has more free. With no rank of its role staying, or none of its role with a pool as
    large, any rank takes them."""
    blocks = [(50, 100), (60, 100), (90, 100), (10, 100)]
    assert plan_handover(blocks, [1], prefill_ranks=2) == {"1": 0}
    assert plan_handover(blocks, [3], prefill_ranks=2) == {"3": 2}
    assert plan_handover(blocks, [1], prefill_ranks=0) == {"1": 2}    # no PD: the most free
    # both decode ranks leave: rank 1 (60 free) takes rank 2's 10 used blocks, then rank 0 and 1 tie at 50
    assert plan_handover(blocks, [2, 3], prefill_ranks=2) == {"2": 1, "3": 0}
    # the pool must be large enough first: the 100-block decode rank cannot hold all a 200-block one held
    assert plan_handover([(200, 200), (10, 100), (50, 200)], [2], prefill_ranks=1) == {"2": 0}


def test_scale_requests_are_checked_by_name_before_they_reach_the_leader():
    """LLM.scale's own checks (the leader, which knows the pools as they are, checks the rest and names the ranks
    to spawn; pd: a job started with PD)."""
    def ask(**kw):
        return {"attention_ranks": None, "expert_ranks": None, "prefill_ranks": None, "decode_ranks": None,
                "retire": [], **kw}
    check_scale(ask(attention_ranks=3, expert_ranks=2, retire=[1]), 8, False)
    check_scale(ask(prefill_ranks=2, decode_ranks=3), 8, True)
    for bad, pd, match in [(ask(prefill_ranks=0), True, "prefill_ranks=0 is invalid"),
                           (ask(decode_ranks=True), True, "decode_ranks=True is invalid"),
                           (ask(attention_ranks=2), True, "attention_ranks=2 for a PD job"),
                           (ask(decode_ranks=2), False, "decode_ranks=2 for a job without PD"),
                           (ask(prefill_ranks=1, decode_ranks=2), False,
                            "prefill_ranks=1 and decode_ranks=2 for a job without PD"),
                           (ask(expert_ranks=9), True, "expert_ranks=9 exceeds the model's 8 experts"),
                           (ask(retire=[0]), True, r"retire=\[0\] is invalid")]:
        with pytest.raises(ValueError, match=match):
            check_scale(bad, 8, pd)


def test_a_prefill_joiner_is_refused_by_name_only_by_a_job_without_pd():
    assert joiner_refusal(9, {"role": "prefill"}, pd=False).startswith("member 9 joins as a prefill rank")
    assert joiner_refusal(9, {"role": "prefill"}, pd=True) is None
    assert joiner_refusal(9, {"role": "decode"}, pd=False) is None
