"""The numpy least_loaded policy as it was before the plan moved onto the device (balancer/water_fill.py): the
reference the device plan is compared with in tests/balancer/test_policy.py. Kept verbatim apart from its base
class and `plan` split in two, `share` (the fractional split) and `plan` (its rounding), so a test can see how
near a running sum was to a rounding boundary. It plans and assigns on the host: counts and ids go through numpy."""
from __future__ import annotations

import numpy as np
import torch

from balancer.placement import Placement

WARM_START_ITERATIONS = 64
PRIOR_WEIGHT = 1e-3   # pull of the least-squares split toward the placement's split (makes it unique)


class NumpyLeastLoaded:
    """Water-filling onto the least-loaded replicas, the same plan on every attention rank.

    Single-replica experts load their rank as they must. The tokens of experts with several replicas are
    split over their replicas' ranks to minimise the sum of squared rank loads (the lexicographically most
    balanced split, which walks load along chains of shared ranks). Without the sign constraint that split is
    a linear function of the per-expert totals, so `set_placement` solves the KKT system once per layer and
    `plan` is one small matrix-vector product. Where that puts a negative share on a replica (a rank already
    over the level from its single experts), the split is solved once more without those replicas, clipped,
    and polished by `iterations` rounds of exact per-expert water-filling, all experts at once, moving `step`
    of the way (block-coordinate descent on the same objective), which can put load back on them.
    Fractional amounts become integer per-replica quotas by rounding running sums. Each attention rank takes
    the slice of every expert's quotas at its offset among the attention ranks (rank order), so the union
    over ranks meets every quota exactly."""

    def __init__(self, placement: Placement, iterations: int = 3, step: float = 0.3):
        self.iterations, self.step = iterations, step
        self.placement = placement
        self.log2phy, self.replica_count = placement.log2phy()
        n, S = placement.num_ranks, placement.num_slots
        self.num_ranks = n
        rep_rank = torch.where(self.log2phy >= 0, self.log2phy // S, n).numpy()   # [L, E, P], pad -> n
        count = self.replica_count.numpy()
        self._valid = self.log2phy.numpy() >= 0
        self._single = [np.flatnonzero(count[layer] == 1) for layer in range(placement.num_layers)]
        self._single_rank = [rep_rank[layer, idx, 0] for layer, idx in enumerate(self._single)]
        self._multi = [np.flatnonzero(count[layer] > 1) for layer in range(placement.num_layers)]
        self._multi_rank = [rep_rank[layer, idx] for layer, idx in enumerate(self._multi)]
        self._phy_np = self.log2phy.clamp(min=0).numpy()
        self._k = np.arange(1, self.log2phy.shape[2] + 1, dtype=np.float64)
        # Warm start: the split that balances the load the placement was made for (even when unknown).
        self._fraction = []
        self._linear = []
        for layer, multi in enumerate(self._multi):
            valid = self._valid[layer, multi]
            even = np.where(valid, 1.0 / np.maximum(valid.sum(axis=1, keepdims=True), 1), 0.0)
            expected = placement.load[layer].double().numpy() if placement.load is not None else None
            if expected is not None and multi.size:
                split = self._split(layer, expected, even * expected[multi][:, None], WARM_START_ITERATIONS)
                even = np.where(valid, split / np.maximum(expected[multi][:, None], 1e-12), even)
            self._fraction.append(even)
            linear = None
            if multi.size:
                # Replicas the expected load leaves empty (their rank is over the level from single experts
                # alone) are taken out of the linear map, one solve at a time, so it holds at that load.
                active = self._valid[layer, multi].copy()
                for _ in range(active.sum()):
                    linear = self._least_squares(layer, even, active)
                    if expected is None:
                        break
                    share = (linear @ expected).reshape(active.shape)
                    negative = active & (share < 0)
                    if not negative.any():
                        break
                    active = _keep_one(active & ~(negative & (share <= share[negative].min())), share)
            # Only the rows of replicas that can take load: a hot expert's row block is padded to the most
            # replicas any expert has, and reading those zero rows dominated a cache-cold plan.
            rows = np.flatnonzero(np.abs(linear).sum(axis=1) > 0) if linear is not None else None
            self._linear.append(None if linear is None else (rows, np.ascontiguousarray(linear[rows])))

    def _least_squares(self, layer: int, fraction: np.ndarray, active: np.ndarray,
                       total: np.ndarray | None = None) -> np.ndarray:
        """The split minimising sum over ranks of load^2 + PRIOR_WEIGHT * |share - fraction * total|^2 subject
        to each expert's shares summing to its total (signs free), with shares only on the active `[M, P]`
        replicas. With total `[E]`: that share `[M, P]`. Without: K `[M * P, E]`, share = K @ total.
        Solved through the Schur complement on the experts: the Hessian over replicas is eps * I plus a
        block of ones per rank, whose inverse has a closed form (Woodbury), leaving an M x M system."""
        multi, rr = self._multi[layer], self._multi_rank[layer]
        E, n = self._valid.shape[1], self.num_ranks
        M, P = active.shape
        T = np.eye(E) if total is None else total.astype(np.float64)[:, None]     # [E, k] columns of totals
        edge = np.flatnonzero(active.ravel())                      # replica entries of share.ravel()
        ranks, experts = rr.ravel()[edge], edge // P

        def per_rank(v: np.ndarray) -> np.ndarray:                 # sum of replica values [m, k] per rank
            out = np.zeros((n, v.shape[1]))
            np.add.at(out, ranks, v)
            return out

        eps = PRIOR_WEIGHT
        single_load = np.zeros((n, T.shape[1]))
        np.add.at(single_load, self._single_rank[layer], T[self._single[layer]])
        r = eps * fraction.ravel()[edge][:, None] * T[multi[experts]] - single_load[ranks]      # [m, k]
        inv_deg = 1.0 / (eps + np.bincount(ranks, minlength=n))   # [n]

        def h_inv(v: np.ndarray) -> np.ndarray:                    # (eps I + A^T A)^-1 v, A: replica -> rank
            return (v - (inv_deg[:, None] * per_rank(v))[ranks]) / eps

        C = np.bincount(experts * n + ranks, minlength=M * n).reshape(M, n).astype(np.float64)
        schur = (np.diag(C.sum(axis=1)) - (C * inv_deg) @ C.T) / eps
        hr = h_inv(r)
        rhs = np.zeros((M, T.shape[1]))
        np.add.at(rhs, experts, hr)
        mu = np.linalg.solve(schur, rhs - T[multi])
        x = hr - h_inv(mu[experts])
        out = np.zeros((M * P, T.shape[1]))
        out[edge] = x
        return out.reshape(M, P) if total is not None else out

    def plan(self, layer: int, total: np.ndarray) -> np.ndarray:
        """total `[E]` int64 pairs per expert over all attention ranks -> quotas `[E, P]` int64 (row e sums to
        total[e], zero on padding). The same input gives the same output on every rank."""
        E, P = self._valid.shape[1:]
        quota = np.zeros((E, P), dtype=np.int64)
        single, multi = self._single[layer], self._multi[layer]
        quota[single, 0] = total[single]
        if multi.size:
            quota[multi] = _round_rows(self.share(layer, total))
        return quota

    def share(self, layer: int, total: np.ndarray) -> np.ndarray:
        """The replicated experts' fractional split `[M, P]` float64 that plan rounds."""
        multi = self._multi[layer]
        if multi.size:
            share = self.linear_share(layer, total)
            if (share < 0).any():
                # Replicas the linear split drains below zero (their rank is over the level): solve again
                # without them, clip what is still negative, then let water-filling put load back where fits.
                c = total[multi].astype(np.float64)
                active = _keep_one(self._valid[layer, multi] & (share > 0), share)
                share = self._least_squares(layer, self._fraction[layer], active, total)
                np.maximum(share, 0.0, out=share)
                row = share.sum(axis=1)
                fallback = self._fraction[layer] * c[:, None]
                share = np.where((row > 0)[:, None], share * (c / np.where(row > 0, row, 1.0))[:, None], fallback)
                share = self._split(layer, total, share, self.iterations)
            return share
        return np.zeros((0, self._valid.shape[2]))

    def linear_share(self, layer: int, total: np.ndarray) -> np.ndarray:
        """The linear map's split of total `[E]` over the replicated experts' replicas -> `[M, P]` float64."""
        rows, K = self._linear[layer]
        share = np.zeros(self._valid.shape[2] * len(self._multi[layer]))
        share[rows] = K @ total.astype(np.float64)
        return share.reshape(len(self._multi[layer]), -1)

    def _split(self, layer: int, total: np.ndarray, share: np.ndarray, iterations: int) -> np.ndarray:
        """Improve share `[M, P]` (tokens of each replicated expert per replica) by water-filling iterations."""
        n = self.num_ranks
        rr, flat_rr = self._multi_rank[layer], self._multi_rank[layer].ravel()
        c_col = share.sum(axis=1, keepdims=True)
        # float even when no expert is single (bincount of nothing is int64)
        load = np.bincount(self._single_rank[layer], weights=total[self._single[layer]],
                           minlength=n + 1).astype(np.float64)
        load += np.bincount(flat_rr, weights=share.ravel(), minlength=n + 1)
        load[n] = np.inf                                         # padding replicas never take tokens
        k = self._k
        with np.errstate(invalid="ignore"):
            for _ in range(iterations):
                others = load[rr]
                others -= share                                  # [M, P] rank loads without this expert
                # Pouring c over levels o (sorted) fills to min over j of (c + o_1 + ... + o_j) / j;
                # padding sits at +inf, so it never lowers the level and never takes a share.
                lv = np.sort(others, axis=1)
                np.cumsum(lv, axis=1, out=lv)
                lv += c_col
                lv /= k
                delta = lv.min(axis=1)[:, None] - others
                np.maximum(delta, 0.0, out=delta)
                delta -= share
                delta *= self.step
                share += delta
                load += np.bincount(flat_rr, weights=delta.ravel(), minlength=n + 1)
        return share

    def choose(self, layer, topk_ids, counts=None, source=0):
        if counts is None:
            raise ValueError("least_loaded needs every attention rank's per-expert counts")
        counts = counts.cpu().numpy()
        quota = self.plan(layer, counts.sum(axis=0))
        return self.apply(layer, topk_ids, quota, counts[:source].sum(axis=0), counts[source])

    def apply(self, layer: int, topk_ids: torch.Tensor, quota: np.ndarray, before: np.ndarray,
              mine: np.ndarray) -> torch.Tensor:
        """This rank's pairs take global positions [before[e], before[e] + mine[e]) in expert e's order;
        replica j of e owns positions [sum(quota[e, :j]), sum(quota[e, :j + 1]))."""
        cum = np.cumsum(quota, axis=1)
        lo, hi = before[:, None], (before + mine)[:, None]
        take = np.clip(cum, lo, hi) - np.clip(cum - quota, lo, hi)        # [E, P] my pairs per replica
        flat = topk_ids.reshape(-1).cpu().numpy()
        order = _stable_order(flat, quota.shape[0])
        out = np.empty_like(flat)
        out[order] = np.repeat(self._phy_np[layer].ravel(), take.ravel())
        return torch.from_numpy(out).view(topk_ids.shape).to(topk_ids.device)


def _stable_order(flat: np.ndarray, num_experts: int) -> np.ndarray:
    """Stable argsort of expert ids; small integer types let numpy use its radix sort."""
    small = np.uint8 if num_experts <= 256 else np.uint16 if num_experts <= 65536 else flat.dtype
    return np.argsort(flat.astype(small, copy=False), kind="stable")


def _keep_one(active: np.ndarray, share: np.ndarray) -> np.ndarray:
    """active `[M, P]` with every row that lost all its replicas given back its largest-share replica (an expert
    with no replica left makes the least-squares system singular)."""
    empty = np.flatnonzero(~active.any(axis=1))
    if empty.size:
        active = active.copy()
        active[empty, np.argmax(share[empty], axis=1)] = True
    return active


def _round_rows(share: np.ndarray) -> np.ndarray:
    """Integers from each row of share `[M, P]` by rounding its running sum: every row keeps its (integer)
    total and no entry moves by a whole unit or more."""
    cum = np.rint(np.cumsum(share, axis=1)).astype(np.int64)
    cum[:, 1:] -= cum[:, :-1].copy()
    return cum
