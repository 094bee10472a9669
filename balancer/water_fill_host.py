"""least_loaded's plan and assignment for CPU ranks, in numpy: balancer/water_fill.py's algorithm, formula for
formula, where the host is the device.

Why a second form: the plan is ~150 calls on arrays of a few dozen numbers, so its cost is the per-call
overhead, ~4-8 us for a torch op on the 2-core dev VM against ~1 us for numpy's. At the shipped model's shape
the torch plan with its fallback took ~0.75 ms per MoE layer and micro-batch (this form: ~0.03 ms), and
least_loaded ran at 0.67-0.78x `static`'s throughput at 1+2 (docs/benchmarks.md has this form's). On the
host, shapes may depend on the data: the fallback runs only when the linear split went negative, and the
assignment repeats each replica's phy id by its count instead of a running count over positions.

The split agrees with water_fill's to float error (numpy and torch sum in their own orders); the quotas agree
wherever no running sum is within float error of a rounding boundary, else by one pair per replica
(tests/balancer/test_policy.py). Every attention rank runs this same code on the same numbers, so they agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from comm.sync_audit import cpu_numpy

from .water_fill import PRIOR_WEIGHT, LayerTables


@dataclass(slots=True, frozen=True)
class HostTables:
    """A layer's `LayerTables` as numpy views of its CPU tensors (no copy)."""

    multi: np.ndarray
    single: np.ndarray
    valid: np.ndarray
    rank: np.ndarray
    on_rank: np.ndarray
    single_on_rank: np.ndarray
    ladder: np.ndarray
    fraction: np.ndarray
    linear_rows: np.ndarray
    linear: np.ndarray
    phy: np.ndarray

    @classmethod
    def of(cls, t: LayerTables) -> HostTables:
        return cls(**{name: cpu_numpy(getattr(t, name)) for name in cls.__slots__})


def linear_share(h: HostTables, tf: np.ndarray) -> np.ndarray:
    """Step 1's split of tf `[E]` float64 over the replicated experts' replicas -> `[M, P]` float64."""
    M, P = h.valid.shape
    out = np.zeros(M * P)
    out[h.linear_rows] = h.linear @ tf
    return out.reshape(M, P)


def keep_one(active: np.ndarray, share: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """water_fill.keep_one: every row of active `[M, P]` left with no replica gets back its largest-share real one."""
    empty = ~active.any(axis=1, keepdims=True)
    best = np.where(valid, share, -np.inf).argmax(axis=1)[:, None]
    return active | (empty & (np.arange(active.shape[1]) == best))


def least_squares(h: HostTables, active: np.ndarray, tf: np.ndarray) -> np.ndarray:
    """water_fill.least_squares for one column of totals tf `[E]` float64 -> shares `[M, P]` float64 (zero off
    the active replicas); the same Schur complement, masks and closed-form inverse."""
    M, P = active.shape
    eps = PRIOR_WEIGHT
    w = active.reshape(-1).astype(np.float64)                # [m]
    on = h.on_rank * w                                       # [n + 1, m] active replicas only
    idx = h.rank.reshape(-1)
    c = tf[h.multi]                                          # [M]
    single_load = h.single_on_rank @ tf                      # [n + 1]
    r = w * (eps * h.fraction.reshape(-1) * np.repeat(c, P) - single_load[idx])
    inv_deg = 1.0 / (eps + on.sum(axis=1))                   # [n + 1]

    def h_inv(v: np.ndarray) -> np.ndarray:                  # (eps I + A^T A)^-1 v, A: active replica -> rank
        return (v - w * (inv_deg * (on @ v))[idx]) / eps

    C = on.reshape(-1, M, P).sum(axis=2).T                   # [M, n + 1] active replicas of mi on rank r
    schur = (np.diag(C.sum(axis=1)) - (C * inv_deg) @ C.T) / eps
    hr = h_inv(r)
    mu = np.linalg.solve(schur, hr.reshape(M, P).sum(axis=1) - c)
    return (hr - h_inv(w * np.repeat(mu, P))).reshape(M, P)


def polish(h: HostTables, tf: np.ndarray, share: np.ndarray, iterations: int, step: float) -> np.ndarray:
    """water_fill.polish: rounds of exact per-expert water-filling on share `[M, P]`, moving `step` of the way."""
    c = share.sum(axis=1, keepdims=True)
    load = h.single_on_rank @ tf + h.on_rank @ share.reshape(-1)      # [n + 1]
    load[-1] = np.inf                                                # padding replicas never take tokens
    for _ in range(iterations):
        others = load[h.rank] - share                                # [M, P] rank loads without this expert
        level = ((np.cumsum(np.sort(others, axis=1), axis=1) + c) / h.ladder).min(axis=1, keepdims=True)
        delta = (np.maximum(level - others, 0.0) - share) * step
        share = share + delta
        load = load + h.on_rank @ delta.reshape(-1)
    return share


def split(h: HostTables, total: np.ndarray, iterations: int, step: float) -> np.ndarray:
    """total `[E]` int64 pairs per expert over all attention ranks -> the replicated experts' split `[M, P]`
    float64 (water_fill.split's steps 1 and 2; the fallback only where step 1 went negative)."""
    tf = total.astype(np.float64)
    if h.multi.size == 0:
        return np.zeros(h.valid.shape)
    linear = linear_share(h, tf)
    if linear.min() >= 0:
        return linear
    c = tf[h.multi]
    active = keep_one(h.valid & (linear > 0), linear, h.valid)
    share = np.maximum(least_squares(h, active, tf), 0.0)
    row = share.sum(axis=1)
    share = np.where((row > 0)[:, None], share * (c / np.where(row > 0, row, 1.0))[:, None],
                     h.fraction * c[:, None])
    return polish(h, tf, share, iterations, step)


def plan(h: HostTables, total: np.ndarray, iterations: int, step: float) -> np.ndarray:
    """total `[E]` int64 -> quotas `[E, P]` int64 (row e sums to total[e], zero on padding): water_fill.plan."""
    E, P = h.phy.shape
    quota = np.zeros((E, P), dtype=np.int64)
    quota[:, 0] = np.where(h.single, total, 0)
    if h.multi.size:
        cum = np.rint(np.cumsum(split(h, total, iterations, step), axis=1)).astype(np.int64)
        cum[:, 1:] -= cum[:, :-1].copy()
        quota[h.multi] = cum
    return quota


def assign(phy: np.ndarray, flat: np.ndarray, quota: np.ndarray, before: np.ndarray, mine: np.ndarray
           ) -> np.ndarray:
    """water_fill.assign on the host: this rank's pairs flat `[N]` int64 experts -> their phy ids `[N]` int64.
    Expert e's pairs of this rank, in token order, take global positions [before[e], before[e] + mine[e]) of
    e's order, and replica p of e owns positions [sum(quota[e, :p]), sum(quota[e, :p + 1])); so this rank's
    pairs of e go, in order, take[e, p] to replica p, and the pairs sorted by expert (stably) take the
    replicas' phy ids repeated by those counts. mine must be the bincount of flat."""
    cum = np.cumsum(quota, axis=1)
    lo, hi = before[:, None], (before + mine)[:, None]
    take = np.clip(cum, lo, hi) - np.clip(cum - quota, lo, hi)       # [E, P] my pairs per replica
    E = quota.shape[0]
    small = np.uint8 if E <= 256 else np.uint16 if E <= 65536 else flat.dtype   # numpy's radix sort for these
    order = np.argsort(flat.astype(small, copy=False), kind="stable")
    out = np.empty_like(flat)
    out[order] = np.repeat(phy.reshape(-1), take.reshape(-1))
    return out
