"""Replica choice: every policy picks a replica of the right expert; least_loaded meets its quotas
exactly across attention ranks, computes the same plan on every rank, and balances skewed routing."""
from __future__ import annotations

import pytest
import torch

from balancer.placement import eplb, slot_capacities
from balancer.policy import LeastLoadedPolicy, make_policy
from tests.dist_utils import run_ranks

E, K, N_RANKS = 32, 4, 8


def skewed_ids(T: int, seed: int, s: float = 1.2) -> torch.Tensor:
    probs = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    probs = probs[torch.randperm(E, generator=torch.Generator().manual_seed(0))]   # the same hot experts
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs.expand(T, E), K, replacement=False, generator=g)


def placement(seed: int = 0):
    load = torch.bincount(skewed_ids(2048, seed).flatten(), minlength=E)[None].repeat(2, 1).double()
    return eplb(load, slot_capacities(E, 8, N_RANKS))


def rank_loads(p, phy: torch.Tensor) -> torch.Tensor:
    return torch.bincount(phy.flatten() // p.num_slots, minlength=p.num_ranks).double()


@pytest.mark.parametrize("name", ["static", "round_robin", "random", "least_loaded"])
def test_every_policy_picks_a_replica_of_the_routed_expert(name):
    p = placement()
    ids = skewed_ids(300, 1)
    counts = torch.bincount(ids.flatten(), minlength=E)[None]
    phy = make_policy(name, p).choose(1, ids, counts, 0)
    assert phy.shape == ids.shape
    assert torch.equal(p.slot2expert[1].flatten()[phy], ids)


def test_least_loaded_quotas_are_met_exactly_across_attention_ranks():
    p = placement()
    policy = LeastLoadedPolicy(p)
    parts = [skewed_ids(T, 10 + i) for i, T in enumerate([100, 0, 257])]   # one rank has no tokens
    counts = torch.stack([torch.bincount(x.flatten(), minlength=E) for x in parts])
    quota = policy.plan(0, counts.sum(0).numpy())
    assert quota.sum(axis=1).tolist() == counts.sum(0).tolist()
    got = torch.zeros(p.num_ranks * p.num_slots, dtype=torch.int64)
    for a, ids in enumerate(parts):
        phy = policy.choose(0, ids, counts, a)
        assert torch.equal(p.slot2expert[0].flatten()[phy], ids)
        got += torch.bincount(phy.flatten(), minlength=got.numel())
    log2phy, _ = p.log2phy()
    want = torch.zeros_like(got)
    valid = log2phy[0] >= 0
    want[log2phy[0][valid]] = torch.from_numpy(quota)[valid]
    assert torch.equal(got, want)


def test_least_loaded_beats_the_static_choices_on_skewed_routing():
    p = placement()
    ids = skewed_ids(4096, 7)
    counts = torch.bincount(ids.flatten(), minlength=E)[None]
    ratio = {}
    for name in ("round_robin", "random", "least_loaded"):
        loads = rank_loads(p, make_policy(name, p).choose(0, ids, counts, 0))
        ratio[name] = float(loads.max() / loads.mean())
    assert ratio["least_loaded"] < min(ratio["round_robin"], ratio["random"])
    assert ratio["least_loaded"] < 1.05


def test_least_loaded_needs_counts():
    with pytest.raises(ValueError, match="per-expert counts"):
        LeastLoadedPolicy(placement()).choose(0, skewed_ids(4, 0))


def _plan_on_rank(rank, world):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    policy = LeastLoadedPolicy(placement())
    ids = skewed_ids(64 * (rank + 1), 100 + rank)               # each rank routes different tokens
    mine = torch.bincount(ids.flatten(), minlength=E)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    counts = torch.stack(every)
    plans = [policy.plan(layer, counts.sum(0).numpy()).tolist() for layer in range(2)]
    phy = policy.choose(0, ids, counts, rank)
    return plans, torch.bincount(phy.flatten(), minlength=N_RANKS * policy.placement.num_slots).tolist()


def test_least_loaded_plan_is_identical_on_every_rank():
    results = run_ranks(_plan_on_rank, 3)
    assert all(r[0] == results[0][0] for r in results)
    # and the ranks' choices add up to the common plan, replica by replica
    total = torch.tensor([r[1] for r in results]).sum(0)
    p = placement()
    log2phy, _ = p.log2phy()
    quota = torch.tensor(results[0][0][0])
    valid = log2phy[0] >= 0
    assert torch.equal(total[log2phy[0][valid]], quota[valid])


def test_least_loaded_when_every_expert_is_replicated():
    # 8 experts on 2 ranks x 14 slots: every expert has replicas (duplicates on a rank are unavoidable)
    p = eplb(torch.ones(1, 8), slot_capacities(8, 20, 2))
    assert int(p.log2phy()[1].min()) > 1
    ids = torch.randint(0, 8, (50, 2), generator=torch.Generator().manual_seed(2))
    counts = torch.bincount(ids.flatten(), minlength=8)[None]
    phy = LeastLoadedPolicy(p).choose(0, ids, counts, 0)
    assert torch.equal(p.slot2expert[0].flatten()[phy], ids)


def _plan_rank_loads(policy: LeastLoadedPolicy, quota) -> torch.Tensor:
    p = policy.placement
    log2phy, _ = p.log2phy()
    valid = log2phy[0] >= 0
    return torch.bincount(log2phy[0][valid] // p.num_slots, weights=torch.from_numpy(quota)[valid].double(),
                          minlength=p.num_ranks)


def test_least_loaded_linear_split_matches_converged_water_filling():
    """The one-product split is as balanced as water-filling run to convergence (the same optimum)."""
    p = placement()
    policy = LeastLoadedPolicy(p)
    for seed in range(3):
        total = torch.bincount(skewed_ids(1024, 20 + seed).flatten(), minlength=E).numpy()
        fast = _plan_rank_loads(policy, policy.plan(0, total))
        converged = LeastLoadedPolicy(p, iterations=2000)
        multi = converged._multi[0]
        share = converged._split(0, total, converged._fraction[0] * total[multi][:, None].astype(float), 2000)
        level = torch.bincount(torch.from_numpy(converged._single_rank[0]),
                               weights=torch.from_numpy(total[converged._single[0]]).double(),
                               minlength=p.num_ranks + 1)
        level += torch.bincount(torch.from_numpy(converged._multi_rank[0].ravel()),
                                weights=torch.from_numpy(share.ravel()), minlength=p.num_ranks + 1)
        assert fast.sum() == total.sum()
        assert fast.max() <= level[:-1].max() + 2          # rounding moves each replica by under one pair


def test_least_loaded_drops_replicas_on_overloaded_ranks():
    """Routing far from the placement's load drives the linear split negative; the fallback still gives
    non-negative quotas that sum to each expert's total, nothing on padding, and beats round_robin."""
    p = placement()
    policy = LeastLoadedPolicy(p)
    flipped = skewed_ids(2048, 3).flip(1)
    ids = (E - 1 - flipped)                              # the cold experts are now the hot ones
    total = torch.bincount(ids.flatten(), minlength=E).numpy()
    multi = policy._multi[0]
    assert (policy.linear_share(0, total) < 0).any()     # the fallback path runs
    quota = policy.plan(0, total)
    assert (quota >= 0).all() and quota.sum(axis=1).tolist() == total.tolist()
    assert (quota[multi][~policy._valid[0, multi]] == 0).all()
    counts = torch.from_numpy(total)[None]
    ll = rank_loads(p, policy.choose(0, ids, counts, 0))
    rr = rank_loads(p, make_policy("round_robin", p).choose(0, ids, counts, 0))
    assert ll.max() <= rr.max()


def test_least_loaded_with_an_idle_replicated_expert():
    """A replicated expert that gets no tokens at all (every share of it rounds to zero or below) still plans."""
    p = placement()
    policy = LeastLoadedPolicy(p)
    multi = policy._multi[0]
    total = torch.bincount(skewed_ids(512, 5).flatten(), minlength=E).numpy()
    total[multi[0]] = 0
    total[multi[-1]] = 0
    quota = policy.plan(0, total)
    assert (quota >= 0).all() and quota.sum(axis=1).tolist() == total.tolist()
