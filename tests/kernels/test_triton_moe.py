"""The Triton fused MoE equals its torch reference (natively on CUDA, under TRITON_INTERPRET=1 on CPU): top-k
1, 2 and 8, slots that receive no rows, rows whose choices all live on other ranks, an empty batch, and the
tile layout that `moe_align` builds, checked against a sort written here."""
from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.moe import fused_moe_ref

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Against the fp32 reference on the same inputs: the kernel keeps SwiGLU and the weighted sum in fp32.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def case(N, S, H, I, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    slots = torch.randint(-1, S, (N, K), generator=g)
    if N >= 4:
        slots[1] = -1                             # a row whose every choice lives elsewhere
        slots[slots == 1] = 0                     # slot 1 receives no rows
    if K > 1 and N >= 4:
        slots[2] = torch.arange(K) % S            # one row using several local slots
    weights = torch.rand(N, K, generator=g)
    w13 = torch.randn(S, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(S, H, I, generator=g) / I ** 0.5
    return [t.to(DEVICE) for t in (x.to(dtype), slots, weights, w13.to(dtype), w2.to(dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,S,H,I,K", [(37, 5, 64, 32, 2), (1, 4, 64, 32, 1), (50, 6, 128, 96, 8),
                                       (300, 3, 64, 48, 2)])
def test_fused_moe_matches_reference(N, S, H, I, K, dtype):
    x, slots, weights, w13, w2 = case(N, S, H, I, K, dtype)
    out = ops.fused_moe(x, slots, weights, w13, w2, "triton")
    expected = fused_moe_ref(x.float(), slots, weights, w13.float(), w2.float())
    assert out.dtype == dtype and out.shape == (N, H)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    if N >= 4:
        assert torch.count_nonzero(out[1]) == 0   # nothing local: zero, as the reference


def test_fused_moe_empty_batch():
    x, slots, weights, w13, w2 = case(0, 3, 32, 16, 2, torch.float32)
    assert ops.fused_moe(x, slots, weights, w13, w2, "triton").shape == (0, 32)


@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_tiles(block_m):
    """Each slot's pairs in row order, padded to whole tiles; tiles labelled by slot; pair -> sorted row."""
    from kernels.triton_moe import moe_align
    g = torch.Generator().manual_seed(3)
    N, K, S = 45, 3, 6
    slots = torch.randint(-1, S, (N, K), generator=g)
    slots[slots == 4] = -1
    a = moe_align(slots.to(DEVICE), S, block_m)
    pairs, tile_slot, pos = a.sorted_pairs.cpu().long(), a.tile_slot.cpu().long(), a.pair_pos.cpu().long()
    flat = slots.reshape(-1)
    row = 0
    for s in range(S):
        mine = [p for p in range(N * K) if int(flat[p]) == s]          # pair ids of slot s, ascending
        tiles = -(-len(mine) // block_m)
        assert pairs[row:row + len(mine)].tolist() == mine
        assert (pairs[row + len(mine):row + tiles * block_m] == N * K).all()
        assert (tile_slot[row // block_m:row // block_m + tiles] == s).all()
        assert pos[mine].tolist() == list(range(row, row + len(mine)))
        row += tiles * block_m
    assert (tile_slot[row // block_m:] == S).all() and (pairs[row:a.num_tiles * block_m] == N * K).all()
    assert (pos[flat < 0] == -1).all()
