"""Weight-absorbed MLA attention over the paged latent cache (`ops.paged_mla_decode`, `ops.paged_mla_prefill`)
equals DeepSeek's expanded multi-head latent attention, on both backends (Triton under TRITON_INTERPRET=1 on
CPU).

The oracle never absorbs: per head it expands each cached latent into a no-rope key `latent @ W_UK[h].T` (joined
by the shared rotary key) and a value `latent @ W_UV[h].T`, and runs plain softmax attention in float64. The op
gets the absorbed query `[q_nope @ W_UK[h] | q_pe]` and returns softmax-weighted latents `[.., h, c]`, which
W_UV then lifts to the values' space for the comparison.

Names: h heads, c kv_lora_rank (latent), r qk_rope_head_dim, nope qk_nope_head_dim, v v_head_dim, bs block
size, L context length, Q queries of a sequence.
"""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention, ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, C, R, NOPE, V = 4, 32, 8, 16, 16
SCALE = (NOPE + R) ** -0.5
TOL = 1e-4
BACKENDS = ["torch", "sdpa", pytest.param("cpu", marks=pytest.mark.skipif(
    DEVICE != "cpu" or not cpu_attention.available(), reason="CPU tensors only, and a C compiler")),
            pytest.param("triton", marks=pytest.mark.skipif(not ops.triton_available(),
                                                                      reason="triton is not installed"))]


def mla_setup(lens, bs, extra_cols=1, seed=0):
    """Random MLA weights and per-sequence latents / rotary keys, written into scattered blocks of a cache that
    holds random garbage everywhere else (so an unmasked read of a padding slot or a stale block shows).
    -> (cache `[N, bs, 1, c + r]`, tables `[B, M]` int32 -1 padded with extra_cols spare columns,
    W_UK `[h, nope, c]`, W_UV `[h, v, c]`, latents [`[L, c]`], rope keys [`[L, r]`])."""
    g = torch.Generator().manual_seed(seed)
    w_uk = torch.randn(H, NOPE, C, generator=g) * C ** -0.5
    w_uv = torch.randn(H, V, C, generator=g) * C ** -0.5
    need = [-(-L // bs) for L in lens]
    N = sum(need) + 7
    cache = torch.randn(N, bs, 1, C + R, generator=g) * 3.0
    perm = torch.randperm(N, generator=g).tolist()
    tables = torch.full((len(lens), max(need) + extra_cols), -1, dtype=torch.int32)
    latents, ropes = [], []
    for i, L in enumerate(lens):
        blocks = [perm.pop() for _ in range(need[i])]
        tables[i, :need[i]] = torch.tensor(blocks, dtype=torch.int32)
        lat, rope = torch.randn(L, C, generator=g), torch.randn(L, R, generator=g)
        for t in range(L):   # written by hand: the cache layout itself is part of what is tested
            cache[blocks[t // bs], t % bs, 0] = torch.cat((lat[t], rope[t]))
        latents.append(lat)
        ropes.append(rope)
    return cache.to(DEVICE), tables.to(DEVICE), w_uk, w_uv, latents, ropes


def random_queries(n, seed=1):
    """Per-head no-rope and rotary queries `[n, h, nope]`, `[n, h, r]`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, NOPE, generator=g), torch.randn(n, H, R, generator=g)


def absorb(q_nope, q_pe, w_uk):
    """The absorbed query `[n, h, c + r]`: q_nope[h] @ W_UK[h], then the rotary query."""
    return torch.cat((torch.einsum("nhp,hpc->nhc", q_nope, w_uk), q_pe), dim=-1)


def expanded_mla(q_nope, q_pe, latent, rope, w_uk, w_uv):
    """The non-absorbed MLA in float64: queries `[Q, h, *]` at the last Q of L positions, causal ->
    `[Q, h, v]`."""
    q_nope, q_pe, latent, rope, w_uk, w_uv = (t.double() for t in (q_nope, q_pe, latent, rope, w_uk, w_uv))
    Q, L = q_nope.shape[0], latent.shape[0]
    out = torch.empty(Q, H, V, dtype=torch.float64)
    causal = torch.arange(L)[None, :] <= torch.arange(L - Q, L)[:, None]                     # [Q, L]
    for h in range(H):
        k = torch.cat((latent @ w_uk[h].T, rope), dim=-1)                                      # [L, nope + r]
        v = latent @ w_uv[h].T                                                                 # [L, v]
        s = torch.cat((q_nope[:, h], q_pe[:, h]), dim=-1) @ k.T * SCALE                        # [Q, L]
        out[:, h] = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v
    return out


def lift(latent_out, w_uv):
    """The op's `[n, h, c]` through W_UV -> `[n, h, v]` (float64)."""
    return torch.bmm(latent_out.double().cpu().transpose(0, 1), w_uv.double().transpose(1, 2)).transpose(0, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bs", [4, 16])
def test_decode_equals_expanded_mla(backend, bs):
    """Contexts of 1, bs - 1, bs, bs + 1 and a few blocks, in scattered blocks, tables with spare -1 columns."""
    lens = [1, bs - 1, bs, bs + 1, 37, 9]
    cache, tables, w_uk, w_uv, latents, ropes = mla_setup(lens, bs, extra_cols=2)
    q_nope, q_pe = random_queries(len(lens))
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = ops.paged_mla_decode(absorb(q_nope, q_pe, w_uk).to(DEVICE), cache, tables, lens_t, SCALE, backend,
                               v_dim=C)
    assert out.shape == (len(lens), H, C) and out.dtype == torch.float32
    got = lift(out, w_uv)
    for i, L in enumerate(lens):
        expected = expanded_mla(q_nope[i:i + 1], q_pe[i:i + 1], latents[i], ropes[i], w_uk, w_uv)[0]
        torch.testing.assert_close(got[i], expected, atol=TOL, rtol=TOL, check_dtype=False, msg=f"seq {i} (L={L})")


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_many_sequences_and_a_tight_bound(backend):
    """More sequences than one torch decode group (16: several length-sorted gathers), and Triton sized by a
    host-side max_context_len equal to the longest context rather than the table width."""
    lens = [(7 * i) % 23 + 1 for i in range(19)]
    cache, tables, w_uk, w_uv, latents, ropes = mla_setup(lens, 4, extra_cols=3, seed=5)
    q_nope, q_pe = random_queries(len(lens), seed=6)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    plan = ops.plan_decode_attention(tables, lens_t, 4, backend)
    out = ops.paged_mla_decode(absorb(q_nope, q_pe, w_uk).to(DEVICE), cache, tables, lens_t, SCALE, backend,
                               v_dim=C, max_context_len=max(lens), plan=plan)
    got = lift(out, w_uv)
    for i, L in enumerate(lens):
        expected = expanded_mla(q_nope[i:i + 1], q_pe[i:i + 1], latents[i], ropes[i], w_uk, w_uv)[0]
        torch.testing.assert_close(got[i], expected, atol=TOL, rtol=TOL, check_dtype=False, msg=f"seq {i} (L={L})")


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_long_context_split_kv(backend):
    """Contexts past two of Triton's 256-token minimum partitions, so its decode splits the KV into several
    partitions and merges them (the cache passed as both K and V through the split path too)."""
    lens = [600, 3]
    cache, tables, w_uk, w_uv, latents, ropes = mla_setup(lens, 16, seed=9)
    q_nope, q_pe = random_queries(len(lens), seed=10)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = ops.paged_mla_decode(absorb(q_nope, q_pe, w_uk).to(DEVICE), cache, tables, lens_t, SCALE, backend,
                               v_dim=C, max_context_len=max(lens))
    got = lift(out, w_uv)
    for i, L in enumerate(lens):
        expected = expanded_mla(q_nope[i:i + 1], q_pe[i:i + 1], latents[i], ropes[i], w_uk, w_uv)[0]
        torch.testing.assert_close(got[i], expected, atol=TOL, rtol=TOL, check_dtype=False, msg=f"seq {i} (L={L})")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bs", [4, 16])
def test_prefill_equals_expanded_causal_mla(backend, bs):
    """Chunks in one call: the last 6 of 11 tokens (a cached prefix), a whole 7-token prompt (Q == context), a
    lone first token, 3 tokens after a 17-token prefix, and a whole prompt spanning several blocks."""
    lens, chunks = [11, 7, 1, 20, 2 * bs + 3], [6, 7, 1, 3, 2 * bs + 3]
    cache, tables, w_uk, w_uv, latents, ropes = mla_setup(lens, bs, extra_cols=1, seed=2)
    q_nope, q_pe = random_queries(sum(chunks), seed=3)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = ops.paged_mla_prefill(absorb(q_nope, q_pe, w_uk).to(DEVICE), cache, tables, cu, lens_t, SCALE, backend,
                                v_dim=C)
    assert out.shape == (sum(chunks), H, C) and out.dtype == torch.float32
    got = lift(out, w_uv)
    for i, L in enumerate(lens):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        expected = expanded_mla(q_nope[rows], q_pe[rows], latents[i], ropes[i], w_uk, w_uv)
        torch.testing.assert_close(got[rows], expected, atol=TOL, rtol=TOL, check_dtype=False,
                                   msg=f"seq {i} (L={L}, Q={chunks[i]})")


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_width_keeps_the_rotary_channels(backend):
    """v_dim = c + r (the whole entry) is allowed: its first c channels are the v_dim = c output and the last r
    are the same softmax over the rotary keys."""
    lens = [5, 9]
    cache, tables, w_uk, _, latents, ropes = mla_setup(lens, 4, seed=7)
    q_nope, q_pe = random_queries(len(lens), seed=8)
    q = absorb(q_nope, q_pe, w_uk).to(DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    full = ops.paged_mla_decode(q, cache, tables, lens_t, SCALE, backend, v_dim=C + R)
    assert full.shape == (len(lens), H, C + R)
    torch.testing.assert_close(full[..., :C], ops.paged_mla_decode(q, cache, tables, lens_t, SCALE, backend,
                                                                   v_dim=C))
    for i in range(len(lens)):
        keys = torch.cat((latents[i], ropes[i]), dim=-1).double()                    # [L, c + r]
        probs = torch.softmax(q[i].double().cpu() @ keys.T * SCALE, dim=-1)          # [h, L]
        torch.testing.assert_close(full[i, :, C:].double().cpu(), probs @ ropes[i].double(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v_dim", [0, -1, C + R + 1])
def test_bad_v_dim_is_refused_by_value(backend, v_dim):
    cache, tables, *_ = mla_setup([5], 4)
    q = torch.randn(1, H, C + R, device=DEVICE)
    lens_t = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=rf"v_dim={v_dim}\b"):
        ops.paged_mla_decode(q, cache, tables, lens_t, SCALE, backend, v_dim=v_dim)
    with pytest.raises(ValueError, match=rf"v_dim={v_dim}\b"):
        ops.paged_mla_prefill(q, cache, tables, cu, lens_t, SCALE, backend, v_dim=v_dim)
