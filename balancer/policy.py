"""Replica choice: map each routed (token, expert) pair of one MoE layer to one physical slot.

Policies sit behind `ReplicaPolicy`; they are pure tensor functions (no torch.distributed), so the
runtime, the tests and bench/balancer.py call them the same way.

- static: always the expert's first replica (SGLang's fixed map).
- round_robin: replica = token index mod replica count (vLLM's choice).
- random: a uniformly random replica per pair (SGLang's random dispatch).
- least_loaded: every attention rank knows the layer's per-expert counts of every attention rank (one
  small exchange), runs the same deterministic water-filling over the expert ranks' loads, and takes
  its own share of each expert's per-replica quotas. Ranks agree without a coordinator.

Every choose() is device tensor ops of fixed shapes: no host read (`.item()`, `.tolist()`, `.cpu()`), no
shape that depends on the data, so the decode path never waits on the host here; except least_loaded on CPU
ranks, where the host is the device: it plans and assigns in numpy there (balancer/water_fill_host.py).

Names: L MoE layers, E experts, n expert ranks, P max replicas of one expert, A attention ranks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from comm.sync_audit import cpu_numpy

from . import water_fill, water_fill_host
from .placement import Placement


class ReplicaPolicy(ABC):
    """Chooses a replica for every routed (token, expert) pair of one MoE layer. Its tables live on `device`
    (where the router's ids are), moved there once per placement; choose() never reads anything on the host."""

    needs_counts = False   # True: choose() wants every attention rank's per-expert counts for the layer

    def __init__(self, placement: Placement, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.set_placement(placement)

    def set_placement(self, placement: Placement) -> None:
        """Adopt a new placement (live re-placement); recomputes the lookup tables on the device:
        log2phy `[L, E, P]` int64 phy ids (-1 = padding), replica_count `[L, E]` int64."""
        self.placement = placement
        log2phy, replica_count = placement.log2phy()
        self.log2phy, self.replica_count = log2phy.to(self.device), replica_count.to(self.device)

    @abstractmethod
    def choose(self, layer: int, topk_ids: torch.Tensor, counts: torch.Tensor | None = None,
               source: int = 0) -> torch.Tensor:
        """topk_ids: `[T, K]` int64 logical experts, on the policy's device -> `[T, K]` int64 phy ids
        (rank * S + slot). counts: `[A, E]` int64 per-expert pair counts of every attention rank, on the same
        device (needs_counts policies only); source: this attention rank's row in counts."""


class StaticPolicy(ReplicaPolicy):
    """Always the first replica of each expert (with identity placement: the expert's only copy)."""

    def choose(self, layer, topk_ids, counts=None, source=0):
        return self.log2phy[layer, :, 0][topk_ids]


class RoundRobinPolicy(ReplicaPolicy):
    """Token index modulo the expert's replica count."""

    def choose(self, layer, topk_ids, counts=None, source=0):
        tok = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
        return self.log2phy[layer][topk_ids, tok % self.replica_count[layer][topk_ids]]


class RandomPolicy(ReplicaPolicy):
    """A uniformly random replica per pair, drawn on the device from a seeded generator (reproducible per rank)."""

    def __init__(self, placement: Placement, device: torch.device | str = "cpu", seed: int = 0):
        super().__init__(placement, device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def choose(self, layer, topk_ids, counts=None, source=0):
        u = torch.randint(0, 1 << 30, topk_ids.shape, generator=self.generator, device=topk_ids.device)
        return self.log2phy[layer][topk_ids, u % self.replica_count[layer][topk_ids]]


class LeastLoadedPolicy(ReplicaPolicy):
    """Water-filling onto the least-loaded replicas, the same plan on every attention rank (balancer/water_fill.py).

    Single-replica experts load their rank as they must. The tokens of experts with several replicas are
    split over their replicas' ranks to minimise the sum of squared rank loads (the lexicographically most
    balanced split, which walks load along chains of shared ranks): one precomputed linear map, with a
    re-solve, clip and `iterations` rounds of water-filling (moving `step` of the way) where that map puts a
    negative share on a replica. Fractional amounts become integer per-replica quotas by rounding running sums.
    Each attention rank takes the slice of every expert's quotas at its offset among the attention ranks (rank
    order), so the union over ranks meets every quota exactly. All of it runs on the device, fixed shapes
    (balancer/water_fill.py), except on the CPU (fixed_shape None: off there), where the same algorithm runs in
    numpy, computing its fallback only when it needs it (balancer/water_fill_host.py: numpy's calls cost a
    fraction of torch's on arrays this small)."""

    needs_counts = True

    def __init__(self, placement: Placement, device: torch.device | str = "cpu", iterations: int = 3,
                 step: float = 0.3, fixed_shape: bool | None = None):
        self.iterations, self.step = iterations, step
        self.fixed_shape = torch.device(device).type != "cpu" if fixed_shape is None else fixed_shape
        if not self.fixed_shape and torch.device(device).type != "cpu":
            raise ValueError(f"least_loaded plans on the host only for CPU ranks (device {device}); use "
                             f"fixed_shape=True or None")
        super().__init__(placement, device)

    def set_placement(self, placement: Placement) -> None:
        super().set_placement(placement)
        log2phy, _ = placement.log2phy()
        load = placement.load
        self.tables = [water_fill.build_tables(log2phy[layer], placement.num_ranks, placement.num_slots,
                                    None if load is None else load[layer].to(torch.float64), self.step
                                    ).to(self.device) for layer in range(placement.num_layers)]
        self.host = None if self.fixed_shape else [water_fill_host.HostTables.of(t) for t in self.tables]

    def plan(self, layer: int, total: torch.Tensor) -> torch.Tensor:
        """total `[E]` int64 pairs per expert over all attention ranks -> quotas `[E, P]` int64 (row e sums to
        total[e], zero on padding), on total's device. The same input gives the same output on every rank."""
        if self.host is not None:
            return torch.from_numpy(water_fill_host.plan(self.host[layer], cpu_numpy(total), self.iterations,
                                                         self.step))
        return water_fill.plan(self.tables[layer], total, self.iterations, self.step)

    def split(self, layer: int, total: torch.Tensor) -> torch.Tensor:
        """The fractional split `[M, P]` float64 of the replicated experts (tables[layer].multi) that plan rounds."""
        if self.host is not None:
            return torch.from_numpy(water_fill_host.split(self.host[layer], cpu_numpy(total), self.iterations,
                                                          self.step))
        return water_fill.split(self.tables[layer], total, self.iterations, self.step)

    def linear_share(self, layer: int, total: torch.Tensor) -> torch.Tensor:
        """The linear map's split of total `[E]` over the replicated experts' replicas -> `[M, P]` float64."""
        return water_fill.linear_share(self.tables[layer], total)

    def choose(self, layer, topk_ids, counts=None, source=0):
        if counts is None:
            raise ValueError("least_loaded needs every attention rank's per-expert counts")
        if self.host is not None:      # the host plan and assignment: numpy views, no copy
            every = cpu_numpy(counts)
            quota = water_fill_host.plan(self.host[layer], every.sum(axis=0), self.iterations, self.step)
            flat = cpu_numpy(topk_ids.reshape(-1))
            phy = water_fill_host.assign(self.host[layer].phy, flat, quota, every[:source].sum(axis=0),
                                         every[source])
            return torch.from_numpy(phy).view(topk_ids.shape)
        quota = self.plan(layer, counts.sum(dim=0))
        return self.apply(layer, topk_ids, quota, counts[:source].sum(dim=0), counts[source])

    def apply(self, layer: int, topk_ids: torch.Tensor, quota: torch.Tensor, before: torch.Tensor,
              mine: torch.Tensor) -> torch.Tensor:
        """This rank's pairs take global positions [before[e], before[e] + mine[e]) in expert e's order;
        replica j of e owns positions [sum(quota[e, :j]), sum(quota[e, :j + 1])). mine must be the bincount of
        topk_ids `[T, K]`; quota `[E, P]`, before and mine `[E]`, all int64 on the ids' device."""
        return water_fill.assign(self.tables[layer].phy, topk_ids, quota, before, mine)


POLICIES: dict[str, type[ReplicaPolicy]] = {"static": StaticPolicy, "round_robin": RoundRobinPolicy,
                                            "random": RandomPolicy, "least_loaded": LeastLoadedPolicy}


def make_policy(name: str, placement: Placement, device: torch.device | str = "cpu",
                fixed_shape: bool | None = None) -> ReplicaPolicy:
    """The policy called name, its tables on device (where the router's ids will be). fixed_shape: least_loaded's
    (None: as the device wants; True on the CPU: the GPU's path, for the sync audit); the others always are."""
    if name not in POLICIES:
        raise ValueError(f"balancer {name!r} is not available; choose one of {sorted(POLICIES)}")
    if POLICIES[name] is LeastLoadedPolicy:
        return LeastLoadedPolicy(placement, device, fixed_shape=fixed_shape)
    return POLICIES[name](placement, device)
