"""The Triton KV write, decode and prefill kernels equal their torch references (natively on CUDA, under
TRITON_INTERPRET=1 on CPU), on hostile shapes: GQA 1/4/8, head dims 64/128, block sizes 16/32, contexts of
1, bs-1, bs, bs+1 and a few hundred tokens mixed in one batch, several split-KV partitions, empty batches.

Tolerance per dtype, against the reference evaluated in fp32 on the same (rounded) inputs: the kernels
accumulate in fp32 but, like the reference in that dtype, round the softmax probabilities to the input dtype
before the PV product."""
from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref
from tests.conftest import wider

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
# (query heads per KV head, head dim, block size): each ratio, dim and block size, in differing pairs
SHAPES = [(1, 64, 16), (4, 128, 32), (8, 64, 32), (8, 128, 16)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def paged_cache(lens, kvh, d, bs, dtype, seed=0):
    """Random caches with each sequence's blocks scattered over the pool -> caches, tables `[B, M]` int32."""
    g = torch.Generator().manual_seed(seed)
    N = sum(-(-L // bs) for L in lens) + 5
    kc = torch.randn(N, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(N, bs, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(N, generator=g).tolist()
    tables = torch.full((len(lens), max(1, max((-(-L // bs) for L in lens), default=1))), -1, dtype=torch.int32)
    for i, L in enumerate(lens):
        for j in range(-(-L // bs)):
            tables[i, j] = perm.pop()
    return kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE)


def close(out, expected, dtype):
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g,d,bs", SHAPES)
def test_decode_matches_reference(g, d, bs, dtype):
    kvh = 2 if g < 8 else 1
    lens = [1, bs - 1, bs, bs + 1, 300, 37]
    kc, vc, tables = paged_cache(lens, kvh, d, bs, dtype)
    q = torch.randn(len(lens), g * kvh, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    expected = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, lens_t, d ** -0.5)
    close(ops.paged_decode_attention(q, kc, vc, tables, lens_t, d ** -0.5, "triton", max_context_len=300),
          expected, dtype)


@pytest.mark.parametrize("partition_size", [64, 128])
def test_decode_split_kv_partitions(partition_size):
    """Forced small partitions: a 300-token context spans 5 or 3 of them, a 1-token one only the first."""
    from kernels.triton_attention import paged_decode_attention
    kc, vc, tables = paged_cache([300, 1, 130], 2, 64, 16, torch.float32)
    q = torch.randn(3, 8, 64).to(DEVICE)
    lens = torch.tensor([300, 1, 130], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, kc, vc, tables, lens, 0.125, partition_size=partition_size)
    close(out, paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125), torch.float32)


def test_decode_partitions_fill_the_gpu():
    """One long sequence is split into many partitions; a big batch barely, and never below 256 tokens each."""
    from kernels.triton_attention import MIN_PARTITION, decode_partitions
    parts, size = decode_partitions(1, 8, 32768, 64, 132)
    assert parts >= 32 and parts * size >= 32768 and size >= MIN_PARTITION
    parts, size = decode_partitions(64, 8, 4096, 64, 132)
    assert parts <= 2 and parts * size >= 4096
    assert decode_partitions(4, 2, 1, 64, 132) == (1, 64)


# CI runs each shape once and each dtype at least once (the interpreter is slow); the wider matrix runs all 12
PREFILL_CASES = [(*shape, dtype) if (i, j) in {(0, 0), (1, 1), (2, 2), (3, 2)} else wider(*shape, dtype)
                 for i, shape in enumerate(SHAPES) for j, dtype in enumerate(DTYPES)]


@pytest.mark.parametrize("g,d,bs,dtype", PREFILL_CASES)
def test_prefill_matches_reference(g, d, bs, dtype):
    """Chunks over cached prefixes of every awkward length in one call: a 1-token chunk, a whole bs-1 prompt,
    a chunk ending at a block edge, one past it, and a 100-token chunk after 200 cached tokens."""
    kvh = 2 if g < 8 else 1
    lens, chunks = [1, bs - 1, bs, bs + 1, 300, 37], [1, bs - 1, 3, bs + 1, 100, 20]
    kc, vc, tables = paged_cache(lens, kvh, d, bs, dtype)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(chunks), g * kvh, d, generator=gen).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    expected = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), tables, cu, lens_t, d ** -0.5)
    close(ops.paged_prefill_attention(q, kc, vc, tables, cu, lens_t, d ** -0.5, "triton"), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference(dtype):
    """Slots in scattered blocks, at block edges, and -1 (padding, skipped)."""
    kc, vc, _ = paged_cache([64], 4, 64, 16, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    k = torch.randn(7, 4, 64).to(dtype).to(DEVICE)
    v = torch.randn(7, 4, 64).to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 15, 16, 79, -1, 0], device=DEVICE)
    ops.write_kv(kc, vc, k, v, slots, "triton")
    ops.write_kv(kc2, vc2, k, v, slots, "torch")
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(kc.view(-1, 4, 64)[79], k[4])


def test_empty_batches():
    kc, vc, tables = paged_cache([5], 2, 64, 16, torch.float32)
    q = torch.empty(0, 4, 64, device=DEVICE)
    none = torch.empty(0, dtype=torch.int32, device=DEVICE)
    assert ops.paged_decode_attention(q, kc, vc, tables[:0], none, 0.1, "triton").shape == (0, 4, 64)
    cu = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert ops.paged_prefill_attention(q, kc, vc, tables[:0], cu, none, 0.1, "triton").shape == (0, 4, 64)
    before = kc.clone()
    ops.write_kv(kc, vc, q[:, :2], q[:, :2], none.long(), "triton")
    assert torch.equal(kc, before)
