"""least_loaded's plan and assignment as fixed-shape torch ops on the ids' device: no host read, no shape that
depends on the data, no Python loop over experts or tokens, and the same result on every attention rank.

Names: E experts, P most replicas of one expert, n expert ranks, M replicated experts of the layer (more than
one replica), m = M * P replica entries (padding included), N routed pairs of this rank (tokens x top-k).

The tokens of each replicated expert are split over its replicas to minimise the sum over ranks of load^2 plus
PRIOR_WEIGHT * |share - fraction * total|^2 (the prior toward the placement's split makes the optimum unique).
`plan`, per layer:
1. The linear split: without the sign constraint the optimum is linear in the per-expert totals, so
   `build_tables` solves the KKT system once per placement and a plan is one matrix-vector product.
2. The fallback, for a split that step 1 drives negative (a rank already over the level from its single
   experts): solve again without the drained replicas, clip, rescale, and polish by rounds of water-filling. It
   is computed every time, with masks instead of a smaller system, and `torch.where` picks it only where step 1
   went negative: a branch on the data would read it on the host. The fallback is ~110 of the plan's ~150 ops.
   CPU ranks run the same algorithm in numpy instead, branching (balancer/water_fill_host.py).
3. Integer quotas by rounding running sums: every row keeps its total and no entry moves by a whole unit.
`assign` then gives each of this rank's pairs its replica by the pair's rank among the pairs of its expert.

Determinism: sums over the replicas on a rank are products with 0/1 incidence matrices, never bincount or
scatter_add with float weights (on CUDA their atomics add in a varying order). The numpy implementation this
replaces (kept in tests/balancer/least_loaded_numpy.py) summed in another order: the plans agree where no
running sum is within float error of a rounding boundary, and within one pair per replica where one is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

PRIOR_WEIGHT = 1e-3          # pull of the least-squares split toward the placement's split (makes it unique)
WARM_START_ITERATIONS = 64   # water-filling rounds for the split of the load the placement was made for
F64 = torch.float64


@dataclass(slots=True)
class LayerTables:
    """One layer's fixed tables, on the policy's device, built once per placement by `build_tables`.

    multi `[M]` int64: the replicated experts; single `[E]` bool: experts with one replica;
    valid `[M, P]` bool: real replicas (False = padding); rank `[M, P]` int64: each replica's expert rank, n = padding;
    on_rank `[n + 1, m]` float64: 1 where replica entry i = mi * P + p sits on rank r (padding on row n);
    single_on_rank `[n + 1, E]` float64: 1 where single expert e sits on rank r;
    ladder `[P]` float64: 1..P; fraction `[M, P]` float64: the placement's split of each expert (rows sum to 1);
    linear_rows `[R]` int64, linear `[R, E]` float64: the KKT map, share.view(m)[linear_rows] = linear @ total
    (only the rows of replicas that can take load: reading the padding's zero rows dominated a cold plan);
    phy `[E, P]` int64: log2phy with padding 0."""

    multi: torch.Tensor
    single: torch.Tensor
    valid: torch.Tensor
    rank: torch.Tensor
    on_rank: torch.Tensor
    single_on_rank: torch.Tensor
    ladder: torch.Tensor
    fraction: torch.Tensor
    linear_rows: torch.Tensor
    linear: torch.Tensor
    phy: torch.Tensor

    def to(self, device: torch.device | str) -> LayerTables:
        return LayerTables(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def build_tables(log2phy: torch.Tensor, num_ranks: int, num_slots: int, expected: torch.Tensor | None,
                 step: float) -> LayerTables:
    """Tables for one layer (on the host, once per placement). log2phy `[E, P]` int64 phy ids (rank * S + slot),
    -1 = padding; expected `[E]` float64: the load the placement was made for, or None (unknown: even split)."""
    E, P = log2phy.shape
    n = num_ranks
    count = (log2phy >= 0).sum(dim=1)
    multi = torch.nonzero(count > 1).flatten()
    rank_all = torch.where(log2phy >= 0, log2phy // num_slots, n)
    valid, rank = log2phy[multi] >= 0, rank_all[multi]
    M = multi.numel()
    on_rank = torch.nn.functional.one_hot(rank.reshape(-1), n + 1).T.to(F64)
    single_on_rank = torch.zeros(n + 1, E, dtype=F64)
    single_on_rank[rank_all[:, 0], torch.arange(E)] = (count == 1).to(F64)
    even = torch.where(valid, 1.0 / valid.sum(dim=1, keepdim=True).clamp(min=1), 0.0)
    t = LayerTables(multi, count == 1, valid, rank, on_rank, single_on_rank, torch.arange(1, P + 1, dtype=F64),
                    even, torch.zeros(0, dtype=torch.int64), torch.zeros(0, E, dtype=F64), log2phy.clamp(min=0))
    if M == 0:
        return t
    # Warm start: the split that balances the load the placement was made for (even when unknown).
    if expected is not None:
        c = expected[multi][:, None]
        split = polish(t, expected, even * c, WARM_START_ITERATIONS, step)
        t.fraction = torch.where(valid, split / c.clamp(min=1e-12), even)
    # Replicas the expected load leaves empty (their rank is over the level from single experts alone) are
    # taken out of the linear map, one solve at a time, so it holds at that load.
    active = valid.clone()
    for _ in range(int(active.sum())):
        linear = least_squares(t, active, torch.eye(E, dtype=F64)).reshape(M * P, E)
        if expected is None:
            break
        share = (linear @ expected).view(M, P)
        negative = active & (share < 0)
        if not negative.any():
            break
        active = keep_one(active & ~(negative & (share <= share[negative].min())), share, valid)
    t.linear_rows = torch.nonzero(linear.abs().sum(dim=1) > 0).flatten()
    t.linear = linear[t.linear_rows].contiguous()
    return t


def keep_one(active: torch.Tensor, share: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """active `[M, P]` with every row that lost all its replicas given back its largest-share real replica (an
    expert with no replica left makes the least-squares system singular)."""
    empty = ~active.any(dim=1, keepdim=True)
    best = torch.where(valid, share, -math.inf).argmax(dim=1, keepdim=True)
    return active | (empty & (torch.arange(active.shape[1], device=active.device) == best))


def least_squares(t: LayerTables, active: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """The split minimising sum over ranks of load^2 + PRIOR_WEIGHT * |share - fraction * total|^2 subject to
    each expert's shares summing to its total (signs free), with shares only on the active `[M, P]` replicas.
    totals `[E, k]` float64 columns -> shares `[M, P, k]` float64 (zero off the active replicas); with the
    identity for totals, the linear map. Solved through the Schur complement on the experts: the Hessian over
    replicas is eps * I plus a block of ones per rank, whose inverse has a closed form (Woodbury), leaving an
    M x M system. Inactive replicas are masked out, so the shapes do not depend on which are active."""
    M, P = active.shape
    k = totals.shape[1]
    eps = PRIOR_WEIGHT
    w = active.reshape(-1, 1).to(F64)                        # [m, 1]
    on = t.on_rank * w.T                                     # [n + 1, m] active replicas only
    idx = t.rank.reshape(-1)
    c = totals[t.multi]                                      # [M, k]
    single_load = t.single_on_rank @ totals                  # [n + 1, k]
    r = w * (eps * t.fraction.reshape(-1, 1) * c[:, None].expand(M, P, k).reshape(-1, k) - single_load[idx])
    inv_deg = 1.0 / (eps + on.sum(dim=1))                    # [n + 1]

    def h_inv(v: torch.Tensor) -> torch.Tensor:              # (eps I + A^T A)^-1 v, A: active replica -> rank
        return (v - w * (inv_deg[:, None] * (on @ v))[idx]) / eps

    C = on.view(on.shape[0], M, P).sum(dim=2).T              # [M, n + 1] active replicas of mi on rank r
    schur = (torch.diag(C.sum(dim=1)) - (C * inv_deg) @ C.T) / eps
    hr = h_inv(r)
    # solve_ex: linalg.solve would read its error code on the host; schur is positive definite here
    mu = torch.linalg.solve_ex(schur, hr.view(M, P, k).sum(dim=1) - c).result
    return (hr - h_inv(w * mu[:, None].expand(M, P, k).reshape(-1, k))).view(M, P, k)


def polish(t: LayerTables, total: torch.Tensor, share: torch.Tensor, iterations: int, step: float) -> torch.Tensor:
    """Improve share `[M, P]` float64 (tokens of each replicated expert per replica; total `[E]` float64) by
    rounds of exact per-expert water-filling, all experts at once, moving `step` of the way (block-coordinate
    descent on the same objective)."""
    c = share.sum(dim=1, keepdim=True)
    load = t.single_on_rank @ total + t.on_rank @ share.reshape(-1)      # [n + 1]
    load[-1] = math.inf                                                  # padding replicas never take tokens
    for _ in range(iterations):
        others = load[t.rank] - share                                    # [M, P] rank loads without this expert
        # Pouring c over levels o (sorted) fills to min over j of (c + o_1 + ... + o_j) / j;
        # padding sits at +inf, so it never lowers the level and never takes a share.
        level = ((others.sort(dim=1).values.cumsum(dim=1) + c) / t.ladder).amin(dim=1, keepdim=True)
        delta = ((level - others).clamp(min=0) - share) * step
        share = share + delta
        load = load + t.on_rank @ delta.reshape(-1)
    return share


def linear_share(t: LayerTables, total: torch.Tensor) -> torch.Tensor:
    """Step 1's split of total `[E]` over the replicated experts' replicas -> `[M, P]` float64."""
    M, P = t.valid.shape
    out = torch.zeros(M * P, dtype=F64, device=total.device)
    return out.index_copy(0, t.linear_rows, t.linear @ total.to(F64)).view(M, P)


def split(t: LayerTables, total: torch.Tensor, iterations: int, step: float) -> torch.Tensor:
    """total `[E]` int64 pairs per expert over all attention ranks -> the replicated experts' split `[M, P]`
    float64 (steps 1 and 2; row mi sums to total[multi[mi]], zero on padding): the fallback computed every time
    and picked with `torch.where` (no host read)."""
    tf = total.to(F64)
    if t.multi.numel() == 0:              # fixed by the placement, not by the counts
        return tf.new_zeros(t.valid.shape)
    # Step 1: the linear split
    linear = linear_share(t, tf)
    # Step 2: the fallback. Solve without the replicas step 1 drained, clip what is still negative, then let
    # water-filling put load back where it fits.
    c = tf[t.multi]
    active = keep_one(t.valid & (linear > 0), linear, t.valid)
    share = least_squares(t, active, tf[:, None])[..., 0].clamp(min=0.0)
    row = share.sum(dim=1)
    share = torch.where((row > 0)[:, None], share * (c / torch.where(row > 0, row, 1.0))[:, None],
                        t.fraction * c[:, None])
    share = polish(t, tf, share, iterations, step)
    return torch.where((linear < 0).any(), share, linear)


def plan(t: LayerTables, total: torch.Tensor, iterations: int, step: float) -> torch.Tensor:
    """total `[E]` int64 pairs per expert over all attention ranks -> quotas `[E, P]` int64 (row e sums to
    total[e], zero on padding)."""
    E, P = t.phy.shape
    quota = torch.zeros(E, P, dtype=torch.int64, device=total.device)
    quota[:, 0] = torch.where(t.single, total, 0)
    # Step 3: integers by rounding running sums
    cum = split(t, total, iterations, step).cumsum(dim=1).round().to(torch.int64)
    return quota.index_copy(0, t.multi, torch.diff(cum, dim=1, prepend=torch.zeros_like(cum[:, :1])))


def assign(phy: torch.Tensor, topk_ids: torch.Tensor, quota: torch.Tensor, before: torch.Tensor,
           mine: torch.Tensor) -> torch.Tensor:
    """This rank's pairs -> their phy ids. topk_ids `[T, K]` int64 experts; phy `[E, P]` int64 replicas' phy ids;
    quota `[E, P]` int64 (the plan); before `[E]` int64: the pairs of the attention ranks ahead of this one;
    mine `[E]` int64: this rank's pairs, which must be the bincount of topk_ids.
    Expert e's pairs of this rank, in token order, take global positions [before[e], before[e] + mine[e]) of e's
    order; replica p of e owns positions [sum(quota[e, :p]), sum(quota[e, :p + 1])). Returns `[T, K]` int64."""
    # Step 1: bound[e, p] = how many of my pairs of e go to replicas 0..p
    bound = quota.cumsum(dim=1).clamp(before[:, None], (before + mine)[:, None]) - before[:, None]
    # Step 2: each pair's position in the stable order by expert
    flat = topk_ids.reshape(-1)
    E, N = quota.shape[0], flat.numel()
    # a narrow key: a CPU sort of uint8 is five times faster than of int64 (numpy's radix sort did the same)
    order = torch.argsort(flat.to(torch.uint8 if E <= 256 else torch.int16 if E <= 32768 else torch.int32),
                          stable=True)
    # Step 3: the (expert, replica) runs in that order end at nondecreasing positions edges `[E * P]`, so the run
    # of position g, whose flat index is e * P + p, is how many runs end at or before g: a running count.
    edges = ((mine.cumsum(dim=0) - mine)[:, None] + bound).view(-1)
    ends = torch.zeros(N + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, edges, torch.ones_like(edges))
    run = ends.cumsum(dim=0)[:N]
    return torch.empty_like(flat).scatter_(0, order, phy.view(-1)[run]).view_as(topk_ids)
