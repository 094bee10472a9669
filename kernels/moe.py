"""Grouped expert FFN (SwiGLU) over the slots an expert rank holds: torch reference.

Names: N received rows, H hidden, K top-k, S slots on this rank, I expert intermediate size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_ffn_ref(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Weighted sum over each row's local experts.

    x: `[N, H]`; slots: `[N, K]` int64 local slot, -1 = that choice lives on another rank;
    weights: `[N, K]` fp32 router weights; w13: `[S, 2I, H]` (gate rows then up rows); w2: `[S, H, I]`.
    Returns `[N, H]` in x.dtype: sum_k weights[n, k] * FFN_{slots[n, k]}(x[n]).
    """
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    rows, ks = torch.nonzero(slots >= 0, as_tuple=True)
    chosen = slots[rows, ks]
    order = torch.argsort(chosen, stable=True)
    rows, ks, chosen = rows[order], ks[order], chosen[order]
    counts = torch.bincount(chosen, minlength=w13.shape[0]).tolist()
    start = 0
    for slot, n in enumerate(counts):  # loop over slots, never over tokens
        if n == 0:
            continue
        r = rows[start:start + n]
        gate, up = F.linear(x[r], w13[slot]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[slot])
        out.index_add_(0, r, (y * weights[r, ks[start:start + n], None]).to(out.dtype))
        start += n
    return out
