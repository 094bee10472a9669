"""Following a drifting hot set: cheap, frequent, incremental re-placement.

A full re-placement (`replan.plan_rebalance`: EPLB from scratch, then the slots that changed) moves many slots
each time, so it runs every `rebalance_interval` steps and lags a hot set that moves. Here instead, every step:
- `imbalance` predicts the max/mean expert-rank load the current placement gives the latest observed load (each
  expert's load split evenly over its replicas, as least-loaded replica choice roughly does), a change detector
  that costs one pass over the slots;
- when it is above a threshold, `incremental_replan` moves at most `max_moves` slots per layer: each move gives
  the expert with the highest load per replica one more replica, in a slot taken from the expert that loses the
  least by giving one up (or an empty slot), on the least loaded rank that does not hold the expert yet, and
  only while that lowers the highest load per replica. The bytes moved per step are bounded by max_moves slots
  a layer. (Choosing moves by the predicted peak rank load instead did worse under least-loaded replica choice,
  which evens load over replicas itself: 2.11 against 2.08 max/mean on bench/balancer.py's drift at 64 ranks.)
Pure tensors (numpy inside), the same answer on every rank. Names as in balancer/placement.py.
"""
from __future__ import annotations

import numpy as np
import torch

from .placement import Placement
from .replan import Replan, plan_moves


def imbalance(placement: Placement, load: torch.Tensor) -> list[float]:
    """Per layer, the predicted max/mean rank load of placement under load `[L, E]` (each expert's load split
    evenly over its replicas; 1.0 for a layer without load)."""
    out = []
    for layer in range(placement.num_layers):
        ranks = _rank_loads(placement.slot2expert[layer].numpy(), load[layer].double().numpy())
        mean = ranks.mean()
        out.append(float(ranks.max() / mean) if mean > 0 else 1.0)
    return out


def _rank_loads(slots: np.ndarray, load: np.ndarray) -> np.ndarray:
    """slots `[n, S]` (-1 empty), load `[E]` -> per-rank load `[n]` with each expert's load split over its
    replicas."""
    held = slots >= 0
    counts = np.bincount(slots[held], minlength=load.shape[0])
    share = np.where(held, load[np.where(held, slots, 0)] / np.maximum(counts[np.where(held, slots, 0)], 1), 0.0)
    return share.sum(axis=1)


def incremental_replan(old: Placement, load: torch.Tensor, max_moves: int, capacity: list[int],
                       threshold: float = 0.0) -> Replan:
    """At most max_moves slot copies per layer towards load `[L, E]` (see the module docstring), on the layers
    whose predicted imbalance is above threshold, within each rank's capacity (capacity[r] slots: the ones past
    it are padding and stay empty) -> the placement and its moves (replan.plan_moves: the source of each copy is
    a rank that holds the expert)."""
    new = old.slot2expert.clone()
    cap = np.asarray(capacity)
    for layer, predicted in enumerate(imbalance(old, load)):
        if predicted > threshold:
            new[layer] = torch.from_numpy(_one_layer(old.slot2expert[layer].numpy().copy(),
                                                     load[layer].double().numpy(), max_moves, cap))
    return Replan(Placement(new, old.num_experts, load), plan_moves(old.slot2expert, new))


def _one_layer(slots: np.ndarray, load: np.ndarray, max_moves: int, capacity: np.ndarray) -> np.ndarray:
    """Greedy: each move gives the expert with the highest load per replica (that some rank lacks) a replica in
    the slot whose loss costs least (an empty one within the rank's capacity, or one of an expert that keeps
    another replica: its new load per replica), on the least loaded rank lacking the expert among equal costs;
    it stops when no slot lowers the highest load per replica. (Ranking the slots by the rank's load after the
    move instead gave the same bench/balancer.py drift figures.) It only adds replicas: a layer unbalanced by
    single-replica experts that share a rank stays so (a full EPLB, rebalance_max_slots=0, moves them)."""
    n, S = slots.shape
    counts = np.bincount(slots[slots >= 0], minlength=load.shape[0])
    rank_of, slot_of = np.divmod(np.arange(n * S), S)
    inside = (slot_of < capacity[rank_of]).reshape(n, S)
    for _ in range(max_moves):
        per = load / np.maximum(counts, 1)
        hot = int(np.argmax(np.where(counts < n, per, -np.inf)))
        if counts[hot] >= n:
            break
        gain = load[hot] / (counts[hot] + 1)
        held = np.where(slots >= 0, slots, 0)
        cost = np.where(slots < 0, 0.0, np.where(counts[held] >= 2, load[held] / np.maximum(counts[held] - 1, 1),
                                                 np.inf))
        ok = inside & ~(slots == hot).any(axis=1, keepdims=True) & np.isfinite(cost)
        if not ok.any():
            break
        ranks = _rank_loads(slots, load)
        c, r = cost.reshape(-1), rank_of
        first = np.maximum(c, gain)
        order = np.lexsort((slot_of, r, ranks[r], c, first, ~ok.reshape(-1)))
        best = order[0]
        if first[best] >= per[hot]:
            break       # no slot lowers the highest load per replica
        r, s = rank_of[best], slot_of[best]
        if slots[r, s] >= 0:
            counts[slots[r, s]] -= 1
        slots[r, s] = hot
        counts[hot] += 1
    return slots
