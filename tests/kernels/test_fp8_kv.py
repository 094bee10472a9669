"""A float8 KV cache (`kv_cache_dtype`) on every attention backend: the writes store torch's saturating cast of
the keys and values, bit for bit, and decode and prefill attention equal dense attention over the keys and
values the test rounds through float8 itself (the oracle never reads the cache).
Triton runs natively on CUDA, else under its interpreter (tests/conftest.py)."""
from __future__ import annotations

import importlib.util
import platform

import pytest
import torch

from kernels import cpu_attention, ops
from tests.kernels.test_paged_attention import dense

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ON_CPU = pytest.mark.skipif(DEVICE != "cpu", reason="the C decode takes CPU tensors (this run's are on CUDA)")
BACKENDS = ["torch", "sdpa", pytest.param("cpu", marks=ON_CPU),
            pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                            reason="no triton"))]


def fp8_cache(lens, dtype, backend, bs=4, kvh=2, d=16, seed=0):
    """Each sequence's keys/values (fp32, some beyond e4m3's 448) written through ops.write_kv into scattered blocks
    of a float8 cache -> caches, int32 tables, and the keys/values as the test rounds them through float8."""
    g = torch.Generator().manual_seed(seed)
    N = sum(-(-L // bs) for L in lens) + 3
    kc = torch.zeros(N, bs, kvh, d, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(N, generator=g).tolist()
    tables = torch.full((len(lens), max(-(-L // bs) for L in lens)), -1, dtype=torch.int32)
    keys, vals = [], []
    for i, L in enumerate(lens):
        table = [perm.pop() for _ in range(-(-L // bs))]
        tables[i, :len(table)] = torch.tensor(table)
        k, v = torch.randn(L, kvh, d, generator=g) * 40, torch.randn(L, kvh, d, generator=g) * 3
        k[0, 0, 0], k[0, 0, 1] = 1000.0 * (-1) ** i, 1e5 * (-1) ** i     # past e4m3's largest, and past e5m2's
        slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(L)], device=DEVICE)
        ops.write_kv(kc, vc, k.to(DEVICE), v.to(DEVICE), slots, backend)
        top = torch.finfo(dtype).max           # 448 (e4m3fn) or 57344 (e5m2): the writes saturate there
        assert float(kc.view(-1, kvh, d)[slots[0], 0, 1].float()) == (1 - 2 * (i % 2)) * top
        rounded = k.clamp(-top, top).to(dtype)
        got_k = kc.view(-1, kvh, d)[slots].cpu()
        assert torch.equal(got_k.view(torch.uint8), rounded.view(torch.uint8)), "written keys differ from the cast"
        keys.append(rounded.float())
        vals.append(v.to(dtype).float())
    return kc, vc, tables.to(DEVICE), keys, vals


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_decode_matches_dense_over_rounded_kv(backend, dtype):
    lens = [9, 1, 16, 5, 12]
    kc, vc, tables, keys, vals = fp8_cache(lens, dtype, backend)
    assert max(float(k.abs().max()) for k in keys) == torch.finfo(dtype).max, "no key reached saturation"
    q = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(1)) * 0.05
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = ops.paged_decode_attention(q.to(DEVICE), kc, vc, tables, lens_t, 0.25, backend).cpu()
    assert out.dtype == torch.float32
    for i in range(len(lens)):
        torch.testing.assert_close(out[i], dense(q[i:i + 1], keys[i], vals[i], 0.25)[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_prefill_matches_dense_over_rounded_kv(backend, dtype):
    """A later chunk (the last 6 of 11), a whole prompt and one token, in one call."""
    lens = [11, 7, 5]
    kc, vc, tables, keys, vals = fp8_cache(lens, dtype, backend)
    q = torch.randn(14, 4, 16, generator=torch.Generator().manual_seed(2)) * 0.05
    cu = torch.tensor([0, 6, 13, 14], dtype=torch.int32)
    out = ops.paged_prefill_attention(q.to(DEVICE), kc, vc, tables, cu.to(DEVICE),
                                      torch.tensor(lens, dtype=torch.int32, device=DEVICE), 0.25, backend).cpu()
    for i in range(3):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        torch.testing.assert_close(out[rows], dense(q[rows], keys[i], vals[i], 0.25), atol=2e-5, rtol=2e-5)


def test_fp8_latent_write_is_the_cast():
    """MLA's latent entries: write_latent stores torch's cast too (its index_copy_ runs on the cache's bytes)."""
    cache = torch.zeros(3, 4, 1, 8, dtype=torch.float8_e4m3fn)
    entry = torch.randn(2, 1, 8) * 300
    ops.write_latent(cache, entry, torch.tensor([6, 1]))
    assert torch.equal(cache.view(12, 1, 8)[[6, 1]].view(torch.uint8), entry.to(cache.dtype).view(torch.uint8))
    assert int(cache.view(torch.uint8).count_nonzero()) == int(entry.to(cache.dtype).view(torch.uint8)
                                                                .count_nonzero())


def read_every_value(backend: str, dtype: torch.dtype, q_dtype: torch.dtype = torch.float32
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token contexts: each sequence's output is its token's values, read back from the cache -> (output,
    the values widened by torch). The values are all 256 bit patterns (subnormals, both zeros, the largest), the
    NaN and infinity patterns set to zero (a saturating cast of finite numbers stores none in e4m3fn; e5m2's
    infinity is left out too). q_dtype: the queries' (and output's) dtype, which holds every float8 value."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    kvh, d = 2, 16
    v = torch.where(bits.isfinite(), bits, 0.0).to(dtype).view(8, kvh, d)
    kc = torch.zeros(8, 1, kvh, d, dtype=dtype, device=DEVICE)
    tables = torch.arange(8, dtype=torch.int32, device=DEVICE)[:, None]
    q = torch.zeros(8, 4, d, dtype=q_dtype, device=DEVICE)
    out = ops.paged_decode_attention(q, kc, v.view(8, 1, kvh, d).to(DEVICE), tables,
                                     torch.ones(8, dtype=torch.int32, device=DEVICE), 1.0, backend).cpu()
    return out, v.to(q_dtype).repeat_interleave(2, dim=1)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_reads_every_finite_value_exactly(backend, dtype, q_dtype):
    out, want = read_every_value(backend, dtype, q_dtype)
    assert out.dtype == q_dtype and torch.equal(out, want)


@ON_CPU
@pytest.mark.skipif(platform.machine() != "x86_64" or not cpu_attention.available(), reason="x86 C decode only")
@pytest.mark.parametrize("dtype", FP8)
def test_the_c_decode_without_f16c_reads_the_same(monkeypatch, dtype):
    """The C decode widens float8 with F16C where the CPU has it (this VM does), else in integer lanes: that form,
    built with -mno-f16c, reads every value exactly too and equals dense attention."""
    if cpu_attention.library(dtype).afserve_kv_widen() != 1:
        pytest.skip("this CPU has no F16C: the default build is the integer form already")
    lib = cpu_attention.build_library(dtype, ("-mno-f16c",))
    assert lib.afserve_kv_widen() == 2
    monkeypatch.setattr(cpu_attention, "library", lambda kv_dtype=torch.float32: lib)
    out, want = read_every_value("cpu", dtype)
    assert torch.equal(out, want)
    test_fp8_decode_matches_dense_over_rounded_kv("cpu", dtype)
