"""Re-placement plans: what placement the expert pool moves to, and which weight copies get it there.

Two occasions, both decided between steps and computed alike on every rank (or once by the leader):
- `plan_rebalance`: the pool is unchanged, the observed load moved (live EPLB);
- `plan_membership`: expert ranks left (died, drained) or joined; every expert must still have a slot.

Both run EPLB on the current load and then keep each expert that stays on a rank in its old slot, so only
experts that arrive on a rank move. A move's source is the destination itself when it already holds the
expert, else the lowest surviving rank holding it, else the checkpoint (src rank -1: read only that expert's
tensors). Names: L MoE layers, E experts, n expert ranks, S slots per rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement import Placement, eplb, slot_capacities, stabilize

CHECKPOINT = -1   # a move's source rank when no surviving rank holds the expert


@dataclass(slots=True)
class Replan:
    """The placement to adopt and the copies to make: moves are (layer, dst rank, dst slot, src rank,
    src slot), expert-pool ranks of the new placement; src rank CHECKPOINT = read from the checkpoint."""

    placement: Placement
    moves: list[tuple[int, int, int, int, int]]

    @property
    def num_from_checkpoint(self) -> int:
        return sum(m[3] == CHECKPOINT for m in self.moves)

    @property
    def num_from_peers(self) -> int:
        return sum(m[3] not in (CHECKPOINT, m[1]) for m in self.moves)


def plan_moves(old: torch.Tensor, new: torch.Tensor, keep: list[int] | None = None
               ) -> list[tuple[int, int, int, int, int]]:
    """Copies that turn old `[L, n_old, S_old]` into new `[L, n_new, S_new]`, in a fixed order every rank
    computes alike. keep[i]: the old rank that new rank i was (-1: a new rank holding nothing); None: the
    same ranks. The source is the destination itself when it held the expert, else the lowest new rank that
    held it, else CHECKPOINT."""
    L, n, _ = new.shape
    keep = list(range(n)) if keep is None else keep
    moves = []
    for layer in range(L):
        rows = [old[layer, k].tolist() if k >= 0 else [] for k in keep]
        holders: dict[int, tuple[int, int]] = {}
        for r, row in enumerate(rows):
            for s, e in enumerate(row):
                if e >= 0:
                    holders.setdefault(e, (r, s))
        for r, row in enumerate(rows):
            here = {e: s for s, e in enumerate(row) if e >= 0}
            for s, e in enumerate(new[layer, r].tolist()):
                if e < 0 or (s < len(row) and row[s] == e):
                    continue
                src = (r, here[e]) if e in here else holders.get(e, (CHECKPOINT, 0))
                moves.append((layer, r, s, *src))
    return moves


def plan_rebalance(old: Placement, load: torch.Tensor, capacity: list[int], rank_node: list[int]) -> Replan:
    """EPLB on load `[L, E]` for the same ranks, slots kept where experts stay."""
    new = stabilize(old.slot2expert, eplb(load, capacity, rank_node).slot2expert)
    return Replan(Placement(new, old.num_experts, load), plan_moves(old.slot2expert, new))


def plan_membership(old: Placement, keep: list[int], redundant_experts: int, rank_node: list[int],
                    load: torch.Tensor | None = None) -> Replan:
    """The expert pool becomes len(keep) ranks (keep[i]: the old rank new rank i was, -1 = joined): EPLB on
    load (None: uniform) over the new ranks' slot capacities, slots kept where experts stay."""
    L, E = old.num_layers, old.num_experts
    capacity = slot_capacities(E, redundant_experts, len(keep))
    load = torch.ones(L, E, dtype=torch.float64) if load is None else load
    fresh = eplb(load, capacity, rank_node).slot2expert
    S = fresh.shape[2]
    was = torch.full_like(fresh, -1)
    for i, k in enumerate(keep):
        if k >= 0:
            width = min(S, old.num_slots)
            was[:, i, :width] = old.slot2expert[:, k, :width]
    new = stabilize(was, fresh)
    return Replan(Placement(new, E, load), plan_moves(old.slot2expert, new, keep))
