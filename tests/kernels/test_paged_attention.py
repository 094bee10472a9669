"""Paged attention references, the SDPA path (kernels/sdpa_attention.py) and the C decode
(kernels/cpu_attention.py) equal dense causal attention over the same keys and values."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention, sdpa_attention
from kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref, plan_decode, write_kv_ref

DECODE = {"torch": paged_decode_attention_ref, "sdpa": sdpa_attention.paged_decode_attention,
          "cpu": lambda *args, plan: cpu_attention.paged_decode_attention(*args)}   # C reads the tables, no plan
PREFILL = {"torch": paged_prefill_attention_ref, "sdpa": sdpa_attention.paged_prefill_attention}


def dense(q, k, v, scale):
    """q `[Q, h, d]` (the last Q positions), k/v `[L, kvh, d]` -> `[Q, h, d]`, causal, GQA by repeat."""
    Q, h, _ = q.shape
    L, kvh, _ = k.shape
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("qhd,lhd->hql", q, k) * scale
    causal = torch.arange(L)[None, :] <= torch.arange(L - Q, L)[:, None]
    s = s.masked_fill(~causal, float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(s, -1), v)


def setup(lens, N=40, bs=4, kvh=2, d=8, seed=0):
    """Scattered blocks holding each sequence's keys/values -> caches, int32 tables `[B, M]` (-1 padded), keys."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.zeros(N, bs, kvh, d), torch.zeros(N, bs, kvh, d)
    perm = torch.randperm(N, generator=g).tolist()  # scattered, non-contiguous blocks
    M = max(-(-L // bs) for L in lens)
    tables = torch.full((len(lens), M), -1, dtype=torch.int32)
    keys, vals = [], []
    for i, L in enumerate(lens):
        table = [perm.pop() for _ in range(-(-L // bs))]
        tables[i, :len(table)] = torch.tensor(table)
        k, v = torch.randn(L, kvh, d, generator=g), torch.randn(L, kvh, d, generator=g)
        write_kv_ref(kc, vc, k, v, torch.tensor([table[j // bs] * bs + j % bs for j in range(L)]))
        keys.append(k)
        vals.append(v)
    return kc, vc, tables, keys, vals


@pytest.mark.parametrize("backend", ["torch", "sdpa", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_attention.available(), reason="no C compiler runs here"))])
@pytest.mark.parametrize("group", [16, 2, 3])  # one group; several length-sorted groups
@pytest.mark.parametrize("host", [False, True])  # the plan from the device lengths, or from a host list
def test_decode_matches_dense(backend, group, host):
    lens = [9, 1, 16, 5, 3, 12, 7]
    kc, vc, tables, keys, vals = setup(lens, N=60)
    q = torch.randn(len(lens), 4, 8)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    plan = plan_decode(tables, lens_t, 4, group, host_lens=lens if host else None)
    out = DECODE[backend](q, kc, vc, tables, lens_t, 0.3, plan=plan)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i], dense(q[i:i + 1], keys[i], vals[i], 0.3)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_prefill_chunks_match_dense(backend):
    """Three sequences in one call: a later chunk (the last 6 of 11), a whole prompt, one token."""
    lens, chunks = [11, 7, 5], [6, 7, 1]
    kc, vc, tables, keys, vals = setup(lens)
    q = torch.randn(sum(chunks), 4, 8)
    cu = torch.tensor([0, 6, 13, 14], dtype=torch.int32)
    out = PREFILL[backend](q, kc, vc, tables, cu, torch.tensor(lens, dtype=torch.int32), 0.3)
    for i in range(3):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        torch.testing.assert_close(out[rows], dense(q[rows], keys[i], vals[i], 0.3), atol=1e-5, rtol=1e-5)


def test_write_kv_skips_padding_slots():
    kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_ref(kc, vc, k, v, torch.tensor([5, -1, 0]))
    torch.testing.assert_close(kc[1, 1], k[0])
    torch.testing.assert_close(vc[0, 0], v[2])
    assert int((kc.abs().sum(dim=(-1, -2)) > 0).sum()) == 2


def test_sdpa_prefill_reads_host_lists_not_the_device_tensors():
    """Given host copies of cu_seqlens and the lengths, the SDPA prefill uses them (here the device tensors are
    deliberately wrong, so reading them would change the result)."""
    lens, chunks = [11, 7], [6, 7]
    kc, vc, tables, keys, vals = setup(lens)
    q = torch.randn(sum(chunks), 4, 8)
    cu, lens_t = torch.tensor([0, 6, 13], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    expected = sdpa_attention.paged_prefill_attention(q, kc, vc, tables, cu, lens_t, 0.3)
    out = sdpa_attention.paged_prefill_attention(q, kc, vc, tables, torch.zeros_like(cu), torch.zeros_like(lens_t),
                                                 0.3, host_cu_seqlens=[0, 6, 13], host_context_lens=lens)
    torch.testing.assert_close(out, expected)
