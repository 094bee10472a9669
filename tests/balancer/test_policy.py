"""Replica choice: every policy picks a replica of the right expert; static, round_robin and random choose as
their host tables did; least_loaded plans what the numpy implementation planned (tests/balancer/
least_loaded_numpy.py), the CPU's numpy plan agrees with the fixed-shape one a GPU runs, meets its
quotas exactly across attention ranks, computes the same plan on every rank and balances skewed routing; and no
policy's choose() reads anything on the host (least_loaded's fixed-shape path, which the GPU runs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from balancer import water_fill, water_fill_host
from balancer.placement import Placement, eplb, slot_capacities
from balancer.policy import POLICIES, LeastLoadedPolicy, make_policy
from tests.balancer.least_loaded_numpy import NumpyLeastLoaded
from tests.dist_utils import run_ranks
from tests.host_reads import HostRead, no_host_reads

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


def counts_of(*parts: torch.Tensor, num_experts: int = E) -> torch.Tensor:
    return torch.stack([torch.bincount(x.flatten(), minlength=num_experts) for x in parts])


@pytest.mark.parametrize("name", ["static", "round_robin", "random", "least_loaded"])
def test_every_policy_picks_a_replica_of_the_routed_expert(name):
    p = placement()
    ids = skewed_ids(300, 1)
    phy = make_policy(name, p).choose(1, ids, counts_of(ids), 0)
    assert phy.shape == ids.shape and phy.dtype == torch.int64
    assert torch.equal(p.slot2expert[1].flatten()[phy], ids)


def test_device_tables_choose_as_the_host_tables_did():
    """The choices the policies made when they indexed host tables per call (written out here)."""
    p = placement()
    log2phy, count = p.log2phy()
    ids = skewed_ids(300, 1)
    tok = torch.arange(ids.shape[0])[:, None]
    g = torch.Generator().manual_seed(5)
    rand = make_policy("random", p)
    rand.generator.manual_seed(5)
    for layer in range(2):
        assert torch.equal(make_policy("static", p).choose(layer, ids), log2phy[layer, :, 0][ids])
        want = log2phy[layer][ids, tok % count[layer][ids]]
        assert torch.equal(make_policy("round_robin", p).choose(layer, ids), want)
        for _ in range(2):                              # the generator's stream goes on from call to call
            u = torch.randint(0, 1 << 30, ids.shape, generator=g)
            assert torch.equal(rand.choose(layer, ids), log2phy[layer][ids, u % count[layer][ids]])


def random_case(seed: int) -> tuple[Placement, list[torch.Tensor]]:
    """A placement of 2 layers (EPLB's, with or without the load it was made for) and 10 routings' per-expert
    totals `[E']` per layer, some experts idle, skew drawn per routing."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=g))
    num_experts = int(torch.randint(n, 40, (1,), generator=g))
    redundant = int(torch.randint(0, 2 * n + 1, (1,), generator=g))
    load = (torch.rand(2, num_experts, generator=g) ** 4 * 1000).double()
    p = eplb(load, slot_capacities(num_experts, redundant, n))
    if seed % 3 == 0:
        p = Placement(p.slot2expert, num_experts)       # the load it was made for is unknown
    totals = []
    for _ in range(20):
        s = float(torch.rand(1, generator=g)) * 2
        probs = (1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s)
        probs = probs[torch.randperm(num_experts, generator=g)]
        T = int(torch.randint(0, 300, (1,), generator=g))
        draws = torch.multinomial(probs, 2 * T + 1, replacement=True, generator=g)
        totals.append(torch.bincount(draws, minlength=num_experts))
    return p, totals


@pytest.mark.parametrize("fixed_shape", [True, False])
def test_least_loaded_plans_what_the_numpy_implementation_planned(fixed_shape):
    """Same splits to float error over many placements and loads. The quotas are equal wherever every running
    sum of the numpy split is clear of a rounding boundary (x.5) and no linear share is within float error of
    the fallback's sign test; elsewhere the two sum in different orders and may round one pair apart."""
    compared = near = failed = 0
    for seed in range(40):
        p, totals = random_case(seed)
        policy, ref = LeastLoadedPolicy(p, fixed_shape=fixed_shape), NumpyLeastLoaded(p)
        for i, total in enumerate(totals):
            layer = i % 2
            quota = policy.plan(layer, total).numpy()
            valid = p.log2phy()[0][layer] >= 0
            assert (quota >= 0).all() and (quota[~valid.numpy()] == 0).all()
            assert quota.sum(axis=1).tolist() == total.tolist()
            try:
                want = ref.plan(layer, total.numpy())
            except IndexError:
                # the numpy plan gave an idle replicated expert, all of whose linear shares were a hair below
                # zero, a padding replica; the device plan picks among real replicas only (checked above)
                failed += 1
                continue
            share = ref.share(layer, total.numpy())
            assert np.allclose(policy.split(layer, total).numpy(), share, rtol=1e-9, atol=1e-6)
            linear = ref.linear_share(layer, total.numpy()) if share.size else share
            cum = np.cumsum(share, axis=1)
            clear = (np.abs(cum - np.floor(cum) - 0.5) > 1e-9).all() and \
                not ((np.abs(linear) < 1e-9) & (linear != 0)).any()
            if clear:
                np.testing.assert_array_equal(quota, want)
                compared += 1
            else:
                assert np.abs(quota - want).max() <= 1
                near += 1
    assert compared >= 0.9 * (compared + near + failed) and failed >= 1, (compared, near, failed)


def test_the_cpu_host_plan_agrees_with_the_device_plan():
    """CPU ranks plan in numpy (balancer/water_fill_host.py), computing the fallback only where the linear split
    went negative; a GPU runs the fixed-shape torch plan, which computes both and picks. The same splits to float
    error, and the same quotas wherever every running sum is clear of a rounding boundary (else one pair apart),
    over cases where the fallback is needed and where it is not."""
    taken = skipped = compared = 0
    for seed in range(40):
        p, totals = random_case(seed)
        fixed, host = LeastLoadedPolicy(p, fixed_shape=True), LeastLoadedPolicy(p)
        assert host.host is not None and fixed.host is None
        for i, total in enumerate(totals):
            layer = i % 2
            share = fixed.split(layer, total).numpy()
            assert np.allclose(host.split(layer, total).numpy(), share, rtol=1e-9, atol=1e-6)
            quota, want = host.plan(layer, total).numpy(), fixed.plan(layer, total).numpy()
            assert quota.sum(axis=1).tolist() == total.tolist() and (quota >= 0).all()
            cum = np.cumsum(share, axis=1)
            if (np.abs(cum - np.floor(cum) - 0.5) > 1e-9).all():
                np.testing.assert_array_equal(quota, want)
                compared += 1
            else:
                assert np.abs(quota - want).max() <= 1
            if fixed.tables[layer].multi.numel() == 0:
                continue                        # nothing replicated: no split at all
            negative = bool((fixed.linear_share(layer, total) < 0).any())
            taken, skipped = taken + negative, skipped + (not negative)
    assert taken >= 50 and skipped >= 50 and compared >= 700, (taken, skipped, compared)
    assert not LeastLoadedPolicy(placement()).fixed_shape
    assert LeastLoadedPolicy(placement(), device="meta").fixed_shape
    with pytest.raises(ValueError, match="on the host only for CPU ranks"):
        LeastLoadedPolicy(placement(), device="meta", fixed_shape=False)


def test_the_cpu_host_assignment_gives_each_pair_the_device_assignments_replica():
    """From the same quotas, the host assignment and the device one give every pair the same replica, on each
    attention rank (one with no tokens among them)."""
    p = placement()
    fixed, host = LeastLoadedPolicy(p, fixed_shape=True), LeastLoadedPolicy(p)
    parts = [skewed_ids(T, 50 + i) for i, T in enumerate([100, 0, 257, 64])]
    counts = counts_of(*parts)
    _assigns_alike(fixed, host, parts, counts)
    # more than 256 experts: the host sorts a uint16 key instead of uint8
    g = torch.Generator().manual_seed(9)
    load = (torch.rand(2, 300, generator=g) ** 3 * 100).double()
    p = eplb(load, slot_capacities(300, 20, 4))
    fixed, host = LeastLoadedPolicy(p, fixed_shape=True), LeastLoadedPolicy(p)
    parts = [torch.stack([torch.multinomial(load[0] + 1, 4, generator=g) for _ in range(T)]) for T in (90, 40)]
    _assigns_alike(fixed, host, parts, counts_of(*parts, num_experts=300))


def _assigns_alike(fixed: LeastLoadedPolicy, host: LeastLoadedPolicy, parts: list[torch.Tensor],
                   counts: torch.Tensor) -> None:
    for layer in range(2):
        quota = fixed.plan(layer, counts.sum(0))
        for a, ids in enumerate(parts):
            want = fixed.apply(layer, ids, quota, counts[:a].sum(0), counts[a])
            got = water_fill_host.assign(host.host[layer].phy, ids.reshape(-1).numpy(), quota.numpy(),
                                         counts[:a].sum(0).numpy(), counts[a].numpy())
            np.testing.assert_array_equal(got, want.reshape(-1).numpy())


def test_least_loaded_assigns_as_the_numpy_implementation_did():
    """From the same quotas, every attention rank gives each of its pairs the replica the numpy apply gave."""
    p = placement()
    policy, ref = LeastLoadedPolicy(p), NumpyLeastLoaded(p)
    parts = [skewed_ids(T, 30 + i) for i, T in enumerate([100, 0, 257, 64])]
    counts = counts_of(*parts)
    quota = ref.plan(1, counts.sum(0).numpy())
    for a, ids in enumerate(parts):
        before, mine = counts[:a].sum(0), counts[a]
        got = policy.apply(1, ids, torch.from_numpy(quota), before, mine)
        assert torch.equal(got, ref.apply(1, ids, quota, before.numpy(), mine.numpy()))


@pytest.mark.parametrize("fixed_shape", [True, None])     # the device plan, and the CPU's host plan
def test_least_loaded_quotas_are_met_exactly_across_attention_ranks(fixed_shape):
    p = placement()
    policy = LeastLoadedPolicy(p, fixed_shape=fixed_shape)
    parts = [skewed_ids(T, 10 + i) for i, T in enumerate([100, 0, 257])]   # one rank has no tokens
    counts = counts_of(*parts)
    quota = policy.plan(0, counts.sum(0))
    assert quota.sum(dim=1).tolist() == counts.sum(0).tolist()
    got = torch.zeros(p.num_ranks * p.num_slots, dtype=torch.int64)
    for a, ids in enumerate(parts):
        phy = policy.choose(0, ids, counts, a)
        assert torch.equal(p.slot2expert[0].flatten()[phy], ids)
        got += torch.bincount(phy.flatten(), minlength=got.numel())
    log2phy, _ = p.log2phy()
    want = torch.zeros_like(got)
    valid = log2phy[0] >= 0
    want[log2phy[0][valid]] = quota[valid]
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_choose_reads_nothing_on_the_host(name):
    p = placement()
    # least_loaded as on a GPU: on the CPU it reads its linear split's sign (CPU memory, no device to wait on)
    policy = LeastLoadedPolicy(p, fixed_shape=True) if name == "least_loaded" else make_policy(name, p)
    parts = [skewed_ids(T, 40 + i) for i, T in enumerate([50, 70])]
    counts = counts_of(*parts)
    want = policy.choose(0, parts[1], counts, 1) if name != "random" else None
    with no_host_reads():
        phy = policy.choose(0, parts[1], counts, 1)
    assert torch.equal(p.slot2expert[0].flatten()[phy], parts[1])
    if want is not None:
        assert torch.equal(phy, want)


def test_the_host_read_check_catches_the_numpy_plan():
    """The check above can fail: the numpy implementation's choose() copies the counts and ids to the host."""
    p = placement()
    ids = skewed_ids(50, 3)
    with pytest.raises(HostRead), no_host_reads():
        NumpyLeastLoaded(p).choose(0, ids, counts_of(ids), 0)


def test_least_loaded_beats_the_static_choices_on_skewed_routing():
    p = placement()
    ids = skewed_ids(4096, 7)
    counts = counts_of(ids)
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
    plans = [policy.plan(layer, counts.sum(0)).tolist() for layer in range(2)]
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
    phy = LeastLoadedPolicy(p).choose(0, ids, counts_of(ids, num_experts=8), 0)
    assert torch.equal(p.slot2expert[0].flatten()[phy], ids)


def _plan_rank_loads(policy: LeastLoadedPolicy, quota: torch.Tensor) -> torch.Tensor:
    p = policy.placement
    log2phy, _ = p.log2phy()
    valid = log2phy[0] >= 0
    return torch.bincount(log2phy[0][valid] // p.num_slots, weights=quota[valid].double(), minlength=p.num_ranks)


def test_least_loaded_linear_split_matches_converged_water_filling():
    """The one-product split is as balanced as water-filling run to convergence (the same optimum)."""
    p = placement()
    policy = LeastLoadedPolicy(p)
    for seed in range(3):
        total = torch.bincount(skewed_ids(1024, 20 + seed).flatten(), minlength=E)
        fast = _plan_rank_loads(policy, policy.plan(0, total))
        t = policy.tables[0]
        tf = total.double()
        share = water_fill.polish(t, tf, t.fraction * tf[t.multi][:, None], 2000, policy.step)
        level = t.single_on_rank @ tf + t.on_rank @ share.reshape(-1)        # [n + 1], the last row padding
        assert fast.sum() == total.sum()
        assert fast.max() <= level[:-1].max() + 2          # rounding moves each replica by under one pair


def test_least_loaded_drops_replicas_on_overloaded_ranks():
    """Routing far from the placement's load drives the linear split negative; the fallback still gives
    non-negative quotas that sum to each expert's total, nothing on padding, and beats round_robin."""
    p = placement()
    policy = LeastLoadedPolicy(p)
    flipped = skewed_ids(2048, 3).flip(1)
    ids = (E - 1 - flipped)                              # the cold experts are now the hot ones
    total = torch.bincount(ids.flatten(), minlength=E)
    t = policy.tables[0]
    assert (policy.linear_share(0, total) < 0).any()     # the fallback path runs
    quota = policy.plan(0, total)
    assert (quota >= 0).all() and quota.sum(dim=1).tolist() == total.tolist()
    assert (quota[t.multi][~t.valid] == 0).all()
    counts = total[None]
    ll = rank_loads(p, policy.choose(0, ids, counts, 0))
    rr = rank_loads(p, make_policy("round_robin", p).choose(0, ids, counts, 0))
    assert ll.max() <= rr.max()


def test_least_loaded_with_an_idle_replicated_expert():
    """A replicated expert that gets no tokens at all (every share of it rounds to zero or below) still plans."""
    p = placement()
    policy = LeastLoadedPolicy(p)
    multi = policy.tables[0].multi
    total = torch.bincount(skewed_ids(512, 5).flatten(), minlength=E)
    total[multi[0]] = 0
    total[multi[-1]] = 0
    quota = policy.plan(0, total)
    assert (quota >= 0).all() and quota.sum(dim=1).tolist() == total.tolist()
