"""The grouped expert FFN equals a per-(row, choice) loop written from the definition."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import moe


def naive(x, slots, weights, w13, w2):
    out = torch.zeros_like(x)
    I = w2.shape[2]
    for n in range(x.shape[0]):
        for k in range(slots.shape[1]):
            s = int(slots[n, k])
            if s >= 0:
                h = F.silu(x[n] @ w13[s, :I].T) * (x[n] @ w13[s, I:].T)
                out[n] += weights[n, k] * (h @ w2[s].T)
    return out


@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("N", [0, 1, 37])
def test_grouped_ffn_matches_definition(monkeypatch, use_grouped_mm, N):
    monkeypatch.setattr(moe, "_HAS_GROUPED_MM", use_grouped_mm and hasattr(F, "grouped_mm"))
    g = torch.Generator().manual_seed(N)
    S, H, I, K = 5, 16, 8, 3
    x = torch.randn(N, H, generator=g)
    slots = torch.randint(-1, S, (N, K), generator=g)
    slots[:, 0] = -1 if N == 0 else slots[:, 0]
    weights = torch.rand(N, K, generator=g)
    w13, w2 = torch.randn(S, 2 * I, H, generator=g), torch.randn(S, H, I, generator=g)
    out = moe.fused_moe_ref(x, slots, weights, w13, w2)
    assert out.shape == (N, H)
    torch.testing.assert_close(out, naive(x, slots, weights, w13, w2), atol=1e-4, rtol=1e-4)


def test_rows_bound_elsewhere_never_reach_the_sum(monkeypatch):
    """The fixed-shape path leaves the grouped GEMMs' rows past the last local pair unset (torch does not
    define them); here they are NaN, and the result must still equal the definition."""
    if not hasattr(F, "grouped_mm"):
        pytest.skip("torch without grouped_mm")
    real = F.grouped_mm

    def poisoned(a, b, *, offs):
        out = real(a, b, offs=offs)
        out[int(offs[-1]):] = float("nan")
        return out

    monkeypatch.setattr(moe.F, "grouped_mm", poisoned)
    g = torch.Generator().manual_seed(3)
    S, H, I, K, N = 4, 16, 8, 2, 23
    x = torch.randn(N, H, generator=g)
    slots = torch.randint(-1, S, (N, K), generator=g)
    slots[::3, 1] = -1
    weights = torch.rand(N, K, generator=g)
    w13, w2 = torch.randn(S, 2 * I, H, generator=g), torch.randn(S, H, I, generator=g)
    out = moe.fused_moe_ref(x, slots, weights, w13, w2)
    torch.testing.assert_close(out, naive(x, slots, weights, w13, w2), atol=1e-4, rtol=1e-4)
