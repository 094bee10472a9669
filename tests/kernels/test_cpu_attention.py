"""The C paged decode (kernels/cpu_attention.py) and the fused ops (kernels/cpu_ops.py): how they are built, chosen
and refused. The decode's results against dense attention are in test_paged_attention.py, test_sinks_window.py and
test_mla.py (backend "cpu"); the fused ops' in test_cpu_ops.py."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention, cpu_ops, ops
from tests.kernels.test_paged_attention import dense, setup

needs_cc = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler runs here")


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty cache directory and no library loaded yet in this process; the normal one is restored after."""
    monkeypatch.setenv("AFSERVE_CACHE_DIR", str(tmp_path))
    caches = [cpu_attention.library, cpu_attention.available, cpu_ops.library, cpu_ops.available]
    for c in caches:
        c.cache_clear()
    yield tmp_path
    for c in caches:
        c.cache_clear()


@needs_cc
def test_builds_once_into_the_cache_dir(fresh_build):
    cpu_attention.library()
    built = sorted(p.name for p in fresh_build.iterdir())
    assert len(built) == 1 and built[0].startswith("paged_decode-") and built[0].endswith(".so")
    cpu_attention.library.cache_clear()
    mtime = (fresh_build / built[0]).stat().st_mtime_ns
    cpu_attention.library()                     # a second process finds it: no rebuild, no temporary left
    assert sorted(p.name for p in fresh_build.iterdir()) == built
    assert (fresh_build / built[0]).stat().st_mtime_ns == mtime
    cpu_ops.library()                           # the fused ops: a library of their own, other flags
    assert [p.name.split("-")[0] for p in sorted(fresh_build.iterdir())] == ["cpu_ops", "paged_decode"]


@pytest.mark.parametrize("cc", ["{dir}/no-such-cc", "ccache-like {dir}/no-such-cc"])
def test_a_missing_compiler_is_named(fresh_build, monkeypatch, cc):
    """$CC is split like a shell word list (a wrapper such as ccache and the compiler)."""
    monkeypatch.setenv("CC", cc.format(dir=fresh_build))
    with pytest.raises(ValueError, match="no-such-cc.*kernel_backend='sdpa'"):
        ops.resolve_backend("cpu", "cpu")
    assert not cpu_attention.available() and not cpu_ops.available()
    assert ops.resolve_backend("auto", "cpu") == "sdpa"      # auto falls back rather than failing
    assert not list(fresh_build.iterdir())


@needs_cc
def test_auto_picks_the_c_kernel_on_the_cpu_only():
    assert cpu_attention.available()
    assert ops.resolve_backend("auto", "cpu") == "cpu"
    with pytest.raises(ValueError, match="CPU only, not on cuda"):
        ops.resolve_backend("cpu", "cuda")


@needs_cc
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 8), (torch.float32, 12)])
def test_what_c_does_not_take_goes_to_sdpa(dtype, d):
    """bf16 caches and head dims that are not whole vectors: the "cpu" backend answers through sdpa."""
    lens = [9, 1, 16, 5]
    kc, vc, tables, keys, vals = setup(lens, N=20, d=d)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(len(lens), 4, d).to(dtype)
    assert not cpu_attention.supports(q, kc, vc)
    out = ops.paged_decode_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), 0.3, "cpu")
    for i in range(len(lens)):
        want = dense(q[i:i + 1].float(), keys[i].to(dtype).float(), vals[i].to(dtype).float(), 0.3)[0]
        torch.testing.assert_close(out[i].float(), want, atol=2e-2, rtol=2e-2)


@needs_cc
def test_long_contexts_and_far_apart_scores():
    """Contexts of several hundred tokens over 16-token blocks, scores far apart (probabilities that underflow
    next to the largest), and a context of exactly one token."""
    lens = [1, 300, 517, 64]
    kc, vc, tables, keys, vals = setup(lens, N=80, bs=16, d=64, seed=3)
    q = torch.randn(len(lens), 4, 64) * 6.0
    out = cpu_attention.paged_decode_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i], dense(q[i:i + 1], keys[i], vals[i], 0.125)[0], atol=1e-5, rtol=1e-5)


@needs_cc
@pytest.mark.parametrize("threads", [2, 3, 8])
def test_threads_split_the_sequences(threads):
    """Over 2048 context tokens in all, so the call splits: every sequence equals dense attention and is
    bit-for-bit what the calling thread alone computes (more threads than sequences leaves some idle). Calls
    back to back: a worker that wakes after a call closed must skip it, not take the next call's sequences
    with the old call's arguments."""
    lens = [700, 3, 650, 1, 400, 333, 90]
    kc, vc, tables, keys, vals = setup(lens, N=200, bs=16, d=64, seed=4)
    q = torch.randn(len(lens), 4, 64)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    try:
        cpu_attention.set_threads(1)
        alone = cpu_attention.paged_decode_attention(q, kc, vc, tables, lens_t, 0.125)
        alone_2q = cpu_attention.paged_decode_attention(2 * q, kc, vc, tables, lens_t, 0.125)
        assert cpu_attention.set_threads(threads) == threads
        split = cpu_attention.paged_decode_attention(q, kc, vc, tables, lens_t, 0.125)
        for i in range(100):     # alternating queries: a stale job would show as the other query's output
            got = cpu_attention.paged_decode_attention((1 + i % 2) * q, kc, vc, tables, lens_t, 0.125)
            assert torch.equal(got, alone_2q if i % 2 else alone), f"call {i}"
    finally:
        cpu_attention.set_threads(1)
    assert torch.equal(split, alone)
    for i in range(len(lens)):
        torch.testing.assert_close(split[i], dense(q[i:i + 1], keys[i], vals[i], 0.125)[0], atol=1e-5, rtol=1e-5)


@needs_cc
def test_bad_thread_counts_are_refused():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=f"threads={bad!r}"):
            cpu_attention.set_threads(bad)


@needs_cc
def test_a_forked_child_starts_its_own_workers():
    """Only the forking thread survives a fork: a child that splits a call must not wait for the parent's
    workers (without the reset it hangs, and the join below times out)."""
    import multiprocessing as mp

    lens = [700, 650, 400, 333]
    kc, vc, tables, keys, vals = setup(lens, N=160, bs=16, d=64, seed=5)
    q = torch.randn(len(lens), 4, 64)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    try:
        cpu_attention.set_threads(2)
        want = cpu_attention.paged_decode_attention(q, kc, vc, tables, lens_t, 0.125)   # workers started here
        ctx = mp.get_context("fork")
        result = ctx.Queue()
        child = ctx.Process(target=_decode_in_child, args=(q, kc, vc, tables, lens_t, result))
        child.start()
        child.join(timeout=30)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive, "the forked child hung in the split decode"
        assert torch.equal(torch.tensor(result.get(timeout=5)), want)
    finally:
        cpu_attention.set_threads(1)


def _decode_in_child(q, kc, vc, tables, lens_t, result) -> None:
    result.put(cpu_attention.paged_decode_attention(q, kc, vc, tables, lens_t, 0.125).tolist())
