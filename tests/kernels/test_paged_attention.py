"""Paged attention references equal dense causal attention over the same keys and values."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_decode_ref, paged_attention_prefill_ref, write_kv


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
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.zeros(N, bs, kvh, d), torch.zeros(N, bs, kvh, d)
    perm = torch.randperm(N, generator=g).tolist()  # scattered, non-contiguous blocks
    tables, keys, vals = [], [], []
    for L in lens:
        nb = -(-L // bs)
        table = [perm.pop() for _ in range(nb)]
        k, v = torch.randn(L, kvh, d, generator=g), torch.randn(L, kvh, d, generator=g)
        slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(L)])
        write_kv(kc, vc, k, v, slots)
        tables.append(table)
        keys.append(k)
        vals.append(v)
    return kc, vc, tables, keys, vals


@pytest.mark.parametrize("group", [16, 2, 3])  # one group; several length-sorted groups
def test_decode_matches_dense(group):
    lens = [9, 1, 16, 5, 3, 12, 7]
    kc, vc, tables, keys, vals = setup(lens, N=60)
    M = max(map(len, tables))
    bt = torch.full((len(lens), M), -1, dtype=torch.int64)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    q = torch.randn(len(lens), 4, 8)
    out = paged_attention_decode_ref(q, kc, vc, bt, torch.tensor(lens), 0.3, group=group)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i], dense(q[i:i + 1], keys[i], vals[i], 0.3)[0], atol=1e-5, rtol=1e-5)


def test_prefill_chunk_matches_dense():
    kc, vc, tables, keys, vals = setup([11])
    q = torch.randn(6, 4, 8)  # the last 6 of 11 positions: a later prefill chunk
    out = paged_attention_prefill_ref(q, kc, vc, torch.tensor(tables[0]), 11, 0.3)
    torch.testing.assert_close(out, dense(q, keys[0], vals[0], 0.3), atol=1e-5, rtol=1e-5)
