"""Expert placement: which expert each physical slot of each expert rank holds.

Names: L MoE layers, E logical experts, R expert ranks, S slots per rank,
phy = physical slot id = rank * S + slot (rank counted within the expert pool).
Pure tensors, no torch.distributed.

`eplb` computes a placement from observed per-expert load, in the manner of DeepSeek's EPLB:
give extra replicas to the experts with the highest load per replica, then pack the replicas,
heaviest first, onto the lightest rank that does not hold that expert yet.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class Placement:
    """slot2expert: `[L, R, S]` int64, the logical expert in each slot, -1 = empty slot."""

    slot2expert: torch.Tensor
    num_experts: int
    load: torch.Tensor | None = None    # `[L, E]` the load it was computed for (eplb), or None (identity)

    def __post_init__(self) -> None:
        assert self.slot2expert.dim() == 3, self.slot2expert.shape
        per_layer = [torch.unique(layer[layer >= 0]).numel() for layer in self.slot2expert]
        if any(n != self.num_experts for n in per_layer):
            raise ValueError(f"placement must hold every one of {self.num_experts} experts in each layer; "
                             f"per layer it holds {per_layer}")

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_ranks: int) -> Placement:
        """One replica per expert, contiguous blocks: rank r holds experts [r*S, (r+1)*S)."""
        if num_ranks < 1 or num_ranks > num_experts:
            raise ValueError(f"need 1 <= expert ranks ({num_ranks}) <= num_experts ({num_experts}); "
                             f"use at most {num_experts} expert ranks")
        sizes = slot_capacities(num_experts, 0, num_ranks)   # ranks differ by at most one expert
        num_slots = sizes[0]
        flat = torch.full((num_ranks * num_slots,), -1, dtype=torch.int64)
        e = 0
        for r, n in enumerate(sizes):
            flat[r * num_slots:r * num_slots + n] = torch.arange(e, e + n)
            e += n
        return cls(flat.view(1, num_ranks, num_slots).repeat(num_layers, 1, 1), num_experts)

    @property
    def num_layers(self) -> int:
        return self.slot2expert.shape[0]

    @property
    def num_ranks(self) -> int:
        return self.slot2expert.shape[1]

    @property
    def num_slots(self) -> int:
        return self.slot2expert.shape[2]

    def log2phy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log2phy `[L, E, max_replicas]` int64 phy ids, -1 = padding; replica_count `[L, E]` int64)."""
        L, E = self.num_layers, self.num_experts
        flat = self.slot2expert.view(L, -1)
        count = torch.zeros(L, E, dtype=torch.int64)
        for layer in range(L):
            valid = flat[layer] >= 0
            count[layer] = torch.bincount(flat[layer][valid], minlength=E)
        max_rep = int(count.max())
        out = torch.full((L, E, max_rep), -1, dtype=torch.int64)
        for layer in range(L):
            phy = torch.nonzero(flat[layer] >= 0).flatten()
            experts = flat[layer][phy]
            order = torch.argsort(experts, stable=True)
            phy, experts = phy[order], experts[order]
            # rank of each replica among its expert's replicas
            starts = torch.cumsum(count[layer], 0) - count[layer]
            idx = torch.arange(phy.numel()) - starts[experts]
            out[layer, experts, idx] = phy
        return out, count


def slot_capacities(num_experts: int, redundant_experts: int, num_ranks: int) -> list[int]:
    """Slots on each expert rank for E + redundant slots in all: ceil on the first ranks, one fewer after."""
    if redundant_experts < 0:
        raise ValueError(f"redundant_experts={redundant_experts} is invalid: pass an integer >= 0")
    total = num_experts + redundant_experts
    if num_ranks < 1 or num_ranks > total:
        raise ValueError(f"need 1 <= expert ranks ({num_ranks}) <= num_experts + redundant_experts ({total})")
    base, extra = divmod(total, num_ranks)
    return [base + (r < extra) for r in range(num_ranks)]


def replica_counts(load: np.ndarray, num_slots: int, max_replicas: int) -> np.ndarray:
    """load `[E]` -> replicas per expert `[E]` int64 summing to num_slots: one each, then every extra slot to
    the expert with the highest load per replica (ties: lowest id), never above max_replicas."""
    E = load.shape[0]
    if num_slots < E:
        raise ValueError(f"{num_slots} slots cannot hold {E} experts")
    counts = np.ones(E, dtype=np.int64)
    heap = [(-float(load[e]), e) for e in range(E)]
    heapq.heapify(heap)
    for _ in range(num_slots - E):
        while True:
            _, e = heapq.heappop(heap)
            if counts[e] < max_replicas:
                break
        counts[e] += 1
        if counts[e] < max_replicas:
            heapq.heappush(heap, (-float(load[e]) / counts[e], e))
    return counts


def pack_replicas(load: np.ndarray, counts: np.ndarray, capacity: list[int], limit: int = 1
                  ) -> list[list[tuple[int, float]]]:
    """Pack counts[e] replicas of each expert e (each carrying load[e] / counts[e]) into bins with the given
    slot capacities: each replica into the lightest bin with a free slot among those holding the fewest
    copies of that expert. Replicated experts go first (most replicas first), then single replicas, heaviest
    first. A replicated expert puts its first replica on a bin that already holds another replicated
    expert, so the bins sharing replicated experts form one connected group over which least-loaded replica
    choice can move load (with plain heaviest-first packing, each expert's replicas land on empty bins and
    the groups stay disjoint). A bin takes at most `limit` copies of an expert while another bin could;
    with limit 1 (ranks) a dead end is fixed by one swap, so a duplicate only happens when an expert has
    more replicas than there are bins. Returns per bin [(expert, replica load), ...]; deterministic."""
    n, E = len(capacity), load.shape[0]
    if int(counts.sum()) != sum(capacity):
        raise ValueError(f"{int(counts.sum())} replicas for {sum(capacity)} slots")
    per_replica = load.astype(np.float64) / counts
    items = sorted((counts[e] == 1, -counts[e] if counts[e] > 1 else 0, -per_replica[e], e, i)
                   for e in range(E) for i in range(int(counts[e])))
    bin_load = np.zeros(n)
    free = np.asarray(capacity, dtype=np.int64).copy()
    held = np.zeros((n, E), dtype=np.int64)
    shared = np.zeros(n, dtype=bool)     # holds a replicated expert
    mean_load = float(load.sum()) / n
    bins: list[list[tuple[int, float]]] = [[] for _ in range(n)]

    def put(b: int, e: int, w: float) -> None:
        bins[b].append((e, w))
        bin_load[b] += w
        free[b] -= 1
        held[b, e] += 1
        shared[b] |= counts[e] > 1

    def swap_for(e: int) -> int | None:
        """Every bin with a free slot already holds e: move some expert e2 from a full bin b2 without e into
        the lightest open bin b (which lacks e2), freeing a slot on b2 for e. Returns b2, or None."""
        open_bins = np.flatnonzero(free > 0)
        b = int(open_bins[np.argmin(bin_load[open_bins])])
        for b2 in np.argsort(bin_load, kind="stable").tolist():
            if held[b2, e] or b2 == b:
                continue
            for i, (e2, w2) in enumerate(bins[b2]):
                if not held[b, e2]:
                    bins[b2].pop(i)
                    bin_load[b2] -= w2
                    held[b2, e2] -= 1
                    free[b2] += 1
                    put(b, e2, w2)
                    return b2
        return None

    for single, _, neg_w, e, i in items:
        w = -neg_w
        open_ = free > 0
        fewest = held[open_, e].min()
        if limit == 1 and fewest > 0 and (held[:, e] == 0).any():
            b = swap_for(e)
            if b is not None:
                put(b, e, w)
                continue
        cand = open_ & (held[:, e] == fewest)
        if not single and i == 0:
            # connect, where a shared bin has room for this replica within the mean bin load
            room = cand & shared & (bin_load + w <= mean_load)
            if room.any():
                cand = room
        b = int(np.argmin(np.where(cand, bin_load, np.inf)))
        put(b, e, w)
    return bins


def eplb(load: torch.Tensor, capacity: list[int], rank_node: list[int] | None = None) -> Placement:
    """Placement from per-layer, per-expert load `[L, E]` (e.g. an EMA of routed token counts) for expert ranks
    with `capacity[r]` slots each. With rank_node (the node of each expert rank, several nodes) it packs
    hierarchically: replicas onto nodes first (balancing the load behind each node, which is what inter-node
    traffic follows), then each node's replicas onto its ranks."""
    load = load.detach().to(torch.float64).cpu().numpy()
    L, E = load.shape
    n, S = len(capacity), max(capacity)
    total = sum(capacity)
    max_replicas = max(n, -(-total // E))  # > n only if a rank has more slots than there are experts
    out = torch.full((L, n, S), -1, dtype=torch.int64)
    nodes = sorted(set(rank_node)) if rank_node is not None else [0]
    members = [[r for r in range(n) if rank_node[r] == node] for node in nodes] if len(nodes) > 1 else []
    node_capacity = [sum(capacity[r] for r in m) for m in members]
    for layer in range(L):
        counts = replica_counts(load[layer], total, max_replicas)
        if len(nodes) == 1:
            bins = pack_replicas(load[layer], counts, capacity)
            for r, b in enumerate(bins):
                out[layer, r, :len(b)] = torch.tensor(sorted(e for e, _ in b))
            continue
        node_bins = pack_replicas(load[layer], counts, node_capacity, limit=max(len(m) for m in members))
        for m, nb in zip(members, node_bins):
            node_counts = np.bincount([e for e, _ in nb], minlength=E)
            node_load = load[layer] * node_counts / counts   # the share of each expert's load this node holds
            keep = node_counts > 0
            sub = pack_replicas(node_load[keep], node_counts[keep], [capacity[r] for r in m])
            ids = np.flatnonzero(keep)
            for r, b in zip(m, sub):
                out[layer, r, :len(b)] = torch.tensor(sorted(int(ids[e]) for e, _ in b))
    return Placement(out, E, torch.from_numpy(load))


def stabilize(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Reorder each rank's slots in new `[L, n, S]` so an expert that stays on a rank keeps its old slot:
    only experts that arrive on a rank need weights moved. Same sets per rank, different slot order."""
    out = torch.full_like(new, -1)
    L, n, S = new.shape
    for layer in range(L):
        for r in range(n):
            was, now = old[layer, r].tolist(), new[layer, r].tolist()
            arriving = [e for e in now if e >= 0]
            for s, e in enumerate(was):
                if e >= 0 and e in arriving:
                    out[layer, r, s] = e
                    arriving.remove(e)
            free = [s for s in range(S) if out[layer, r, s] < 0]
            for s, e in zip(free, arriving):
                out[layer, r, s] = e
    return out


def expert_load(slot2expert: torch.Tensor, slot_counts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per-slot served counts `[L, n, S]` under slot2expert -> per-expert load `[L, E]` float64."""
    L = slot2expert.shape[0]
    flat, counts = slot2expert.reshape(L, -1), slot_counts.reshape(L, -1).to(torch.float64)
    out = torch.zeros(L, num_experts + 1, dtype=torch.float64)
    out.scatter_add_(1, torch.where(flat >= 0, flat, num_experts), counts)
    return out[:, :num_experts]


def step_balance(step_loads: torch.Tensor) -> torch.Tensor:
    """Per-rank, per-step, per-layer pair counts `[n, steps, L]` -> max rank load / mean rank load `[steps, L]`
    (0 for a step without load in that layer)."""
    loads = step_loads.to(torch.float64)
    mean, peak = loads.mean(dim=0), loads.max(dim=0).values            # [steps, L]
    return torch.where(mean > 0, peak / mean.clamp(min=1e-12), 0.0)


def load_balance(step_loads: torch.Tensor) -> list[float]:
    """Per-rank, per-step, per-layer pair counts `[n, steps, L]` -> per layer, the mean over steps with any
    load of (max rank load / mean rank load)."""
    ratio = step_balance(step_loads)
    busy = ratio > 0
    return (ratio.sum(dim=0) / busy.sum(dim=0).clamp(min=1)).tolist()
