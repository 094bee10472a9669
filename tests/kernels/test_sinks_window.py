"""Attention sinks and sliding windows (GPT-OSS) in the paged decode and prefill ops, torch and Triton, against
a dense per-sequence attention written here: each query sees the keys at positions (pos - window, pos], and
the softmax's denominator gains exp(sink) per head."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention, ops
from tests.kernels.test_triton_attention import DEVICE, paged_cache

BACKENDS = ["torch", "sdpa", "triton", pytest.param("cpu", marks=pytest.mark.skipif(
    DEVICE != "cpu" or not cpu_attention.available(), reason="the C kernels take CPU tensors and need a C compiler"))]


def dense(q, k, v, q_pos, scale, sinks, window):
    """q `[Q, h, d]` at positions q_pos `[Q]`, k/v `[L, kvh, d]` -> `[Q, h, d]` in float64."""
    h, kvh = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(h // kvh, dim=1)
    v = v.double().repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("qhd,lhd->hql", q.double(), k) * scale
    pos = torch.arange(k.shape[0])
    keep = pos[None, :] <= q_pos[:, None]
    if window is not None:
        keep &= pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~keep[None], float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.double()[:, None, None].expand(h, s.shape[1], 1)), dim=-1)
    p = torch.softmax(s, dim=-1)[..., :k.shape[0]]
    return torch.einsum("hql,lhd->qhd", p, v)


def gather(cache, table, L, bs):
    rows = [cache[int(table[j // bs]), j % bs] for j in range(L)]
    return torch.stack(rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sinks_on,window", [(True, None), (False, 5), (True, 5), (True, 40)])
def test_decode_sinks_and_window(backend, sinks_on, window):
    bs, kvh, g, d = 16, 2, 2, 32
    lens = [1, 4, 5, 6, 17, 60]
    kc, vc, tables = paged_cache(lens, kvh, d, bs, torch.float32, seed=4)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(lens), kvh * g, d, generator=gen).to(DEVICE)
    sinks = (torch.randn(kvh * g, generator=gen) * 2).to(DEVICE) if sinks_on else None
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = ops.paged_decode_attention(q, kc, vc, tables, lens_t, d ** -0.5, backend, max_context_len=60,
                                     sinks=sinks, window=window)
    for i, L in enumerate(lens):
        k, v = gather(kc.cpu(), tables[i].cpu(), L, bs), gather(vc.cpu(), tables[i].cpu(), L, bs)
        want = dense(q[i:i + 1].cpu(), k, v, torch.tensor([L - 1]), d ** -0.5,
                     None if sinks is None else sinks.cpu(), window)
        torch.testing.assert_close(out[i:i + 1].double().cpu(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("partition_size", [16, 32])
def test_decode_window_and_sinks_over_split_partitions(partition_size):
    """Partitions wholly before the window hold no token; the sink joins in the merge."""
    from kernels.triton_attention import paged_decode_attention
    bs, kvh, g, d, window = 16, 1, 4, 32, 20
    lens = [3, 70, 100]
    kc, vc, tables = paged_cache(lens, kvh, d, bs, torch.float32, seed=6)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens), kvh * g, d, generator=gen).to(DEVICE)
    sinks = torch.randn(kvh * g, generator=gen).to(DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, kc, vc, tables, lens_t, d ** -0.5, 100, partition_size, sinks=sinks,
                                 window=window)
    ref = ops.paged_decode_attention(q, kc, vc, tables, lens_t, d ** -0.5, "torch", sinks=sinks, window=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sinks_on,window", [(True, None), (False, 7), (True, 7), (True, 100)])
def test_prefill_sinks_and_window(backend, sinks_on, window):
    """Chunks over cached prefixes, longer than the window and shorter; one chunk is a whole prompt."""
    bs, kvh, g, d = 16, 2, 2, 32
    ctx = [40, 9, 75]      # context lengths (cached prefix + this chunk)
    qlen = [40, 3, 30]     # this chunk's queries: the last qlen positions
    kc, vc, tables = paged_cache(ctx, kvh, d, bs, torch.float32, seed=8)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(sum(qlen), kvh * g, d, generator=gen).to(DEVICE)
    sinks = (torch.randn(kvh * g, generator=gen) * 2).to(DEVICE) if sinks_on else None
    cu = torch.tensor([0, 40, 43, 73], dtype=torch.int32, device=DEVICE)
    out = ops.paged_prefill_attention(q, kc, vc, tables, cu, torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
                                      d ** -0.5, backend, sinks=sinks, window=window)
    for i, (L, Q) in enumerate(zip(ctx, qlen)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        k, v = gather(kc.cpu(), tables[i].cpu(), L, bs), gather(vc.cpu(), tables[i].cpu(), L, bs)
        want = dense(q[rows].cpu(), k, v, torch.arange(L - Q, L), d ** -0.5,
                     None if sinks is None else sinks.cpu(), window)
        torch.testing.assert_close(out[rows].double().cpu(), want, atol=2e-5, rtol=2e-5)


def test_window_must_be_positive():
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="window=0"):
        ops.paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), 1.0, "torch", window=0)
