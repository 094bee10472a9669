"""Grouped expert FFN (SwiGLU) over the slots an expert rank holds: torch reference (the CPU path and the fused
kernel's oracle).

Names: N received rows, H hidden, K top-k, S slots on this rank, I expert intermediate size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by slot, counts `[S]` rows per slot, w `[S, out, in]` -> `[rows, out]`."""
    if _HAS_GROUPED_MM and not x.is_cuda:  # CUDA grouped_mm wants bf16 on sm90; the loop covers the rest
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for slot, n in enumerate(counts.tolist()):  # loop over slots, never over tokens
        if n:
            out[start:start + n] = F.linear(x[start:start + n], w[slot])
            start += n
    return out


@dataclass(frozen=True, slots=True)
class ExpertAct:
    """The expert FFN's activation on (gate, up): "silu" is SwiGLU, silu(gate) * up; "swiglu_oai" is GPT-OSS's
    clamped form, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = ExpertAct()


def fused_moe_ref(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, act: ExpertAct = SILU) -> torch.Tensor:
    """Weighted sum over each row's local experts.

    x: `[N, H]`; slots: `[N, K]` int64 local slot, -1 = that choice lives on another rank;
    weights: `[N, K]` fp32 router weights; w13: `[S, 2I, H]` (gate rows then up rows); w2: `[S, H, I]`;
    b13 `[S, 2I]`, b2 `[S, H]`: optional biases (GPT-OSS); act: the activation.
    Returns `[N, H]` in x.dtype: sum_k weights[n, k] * FFN_{slots[n, k]}(x[n]), added in slot order.
    """
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    if _HAS_GROUPED_MM and not x.is_cuda:
        return _fused_moe_fixed(x, slots, weights, w13, w2, b13, b2, act, out)
    # Step 1: one (row, k) pair per local choice, sorted by slot (stable: row order within a slot).
    rows, ks = torch.nonzero(slots >= 0, as_tuple=True)
    chosen = slots[rows, ks]
    order = torch.argsort(chosen, stable=True)
    rows, ks, chosen = rows[order], ks[order], chosen[order]
    counts = torch.bincount(chosen, minlength=w13.shape[0])
    # Step 2: grouped GEMMs, SwiGLU between them.
    h = _grouped_linear(x[rows], w13, counts)
    if b13 is not None:
        h = h + b13[chosen]
    gate, up = h.chunk(2, dim=-1)
    y = _grouped_linear(act(gate, up), w2, counts)
    if b2 is not None:
        y = y + b2[chosen]
    # Step 3: weight and add back per row.
    out.index_add_(0, rows, (y * weights[rows, ks, None]).to(out.dtype))
    return out


def _fused_moe_fixed(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None, act: ExpertAct,
                     out: torch.Tensor) -> torch.Tensor:
    """The same sum with every shape fixed by `[N, K]` (no nonzero, no host read): all N * K pairs are sorted
    by slot, pairs bound for another rank (slot -1) last as slot S; the grouped GEMMs' offsets end at the last
    local pair, so those rows are never computed, and their (unset) results are masked out before the add."""
    N, K = slots.shape
    S = w13.shape[0]
    key = torch.where(slots >= 0, slots, S).reshape(-1)                          # [N * K]
    order = torch.argsort(key, stable=True)
    chosen = key[order]
    rows = order // K
    # offs[s]: pairs with slot <= s, read off the sorted keys (fixed size, unlike a bincount's)
    offs = torch.searchsorted(chosen, torch.arange(S, device=x.device), right=True, out_int32=True)
    h = F.grouped_mm(x[rows], w13.transpose(1, 2), offs=offs)
    local = chosen.clamp(max=S - 1)
    if b13 is not None:
        h = h + b13[local]
    gate, up = h.chunk(2, dim=-1)
    y = F.grouped_mm(act(gate, up), w2.transpose(1, 2), offs=offs)
    if b2 is not None:
        y = y + b2[local]
    keep = (chosen < S)[:, None]
    out.index_add_(0, rows, torch.where(keep, y * weights.reshape(-1)[order, None], 0).to(out.dtype))
    return out
