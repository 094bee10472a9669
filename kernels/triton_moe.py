"""Fused MoE (SwiGLU experts) in Triton over the slots an expert rank holds.

Names: N received rows, H hidden, K top-k, S slots, I expert intermediate size, NK = N * K (row, choice)
pairs, BM the tile height. Steps, none of which waits on the host:
  1. `moe_align`: sort the pairs by slot into BM-aligned tiles (torch ops on the device);
  2. grouped GEMM 1 (x @ gate/up) with SwiGLU in its epilogue -> `[tiles * BM, I]`;
  3. grouped GEMM 2 (@ down) scaled by each pair's router weight -> `[tiles * BM, H]` fp32;
  4. one pass adding each row's K results in choice order -> `[N, H]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_common import check_launch, float_dtype_ok, mma, mma_flags


@dataclass(slots=True)
class MoEAlignment:
    """Where each (row, choice) pair sits once sorted by slot, every slot's run padded to whole tiles."""

    sorted_pairs: torch.Tensor   # [num_tiles * BM (+1 spare)] int32 pair id n * K + k; NK = padding
    tile_slot: torch.Tensor      # [num_tiles] int32 the slot each tile belongs to; S = an unused tile
    pair_pos: torch.Tensor       # [NK] int32 the pair's row in the sorted order; -1 = lives on another rank
    num_tiles: int


def moe_align(slots: torch.Tensor, num_slots: int, block_m: int) -> MoEAlignment:
    """slots `[N, K]` int64 (-1 = elsewhere) -> the tiles. num_tiles is a bound known on the host (NK pairs
    plus each slot's padding), so nothing here synchronises; tiles past the last used one are unused."""
    S, NK = num_slots, slots.numel()
    device = slots.device
    flat = slots.reshape(-1)
    key = torch.where(flat >= 0, flat, S)                                         # elsewhere: bucket S, last
    counts = torch.zeros(S + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    order = torch.argsort(key, stable=True)                                       # pair ids by slot, row order kept
    padded = (counts[:S] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    num_tiles = -(-(NK + S * (block_m - 1)) // block_m)
    cap = num_tiles * block_m
    # Step 1: pair j of the sorted order goes to its slot's padded start + its rank inside the slot.
    skey = key[order]
    rank = torch.arange(NK, device=device) - (torch.cumsum(counts, 0) - counts)[skey]
    start = torch.cat([padded_end - padded, padded_end.new_full((1,), cap)])       # bucket S -> the spare row
    dest = torch.where(skey < S, start[skey] + rank, cap)
    sorted_pairs = torch.full((cap + 1,), NK, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    pair_pos = torch.empty(NK, dtype=torch.int32, device=device)
    pair_pos.scatter_(0, order, torch.where(skey < S, dest, -1).to(torch.int32))
    # Step 2: the slot of each tile: the first slot whose padded run ends after the tile's first row.
    tile_start = torch.arange(num_tiles, device=device) * block_m
    tile_slot = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return MoEAlignment(sorted_pairs, tile_slot, pair_pos, num_tiles)


@triton.jit
def _tile(pid, num_tiles, num_n, tile_slot_ptr, pairs_ptr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (column block, tile's slot, the tile's sorted rows `[BLOCK_M]`, their pair ids). GROUP_M tiles
    sharing a column block run together (L2 reuse)."""
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    pid_m = first + (pid % per_group) % size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(tile_slot_ptr + pid_m).to(tl.int64)
    return (pid % per_group) // size, slot, offs_m, tl.load(pairs_ptr + offs_m)


@triton.jit
def _gemm1_swiglu_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, tile_slot_ptr, num_pairs, num_tiles, S, H, I,
                         stride_x, stride_ws, stride_wr, stride_o,
                         K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[r, i] = silu(x[row] . gate_i) * (x[row] . up_i) for sorted row r of a tile; w `[S, 2I, H]`."""
    pid_n, slot, offs_m, pair = _tile(tl.program_id(0), num_tiles, tl.cdiv(I, BLOCK_N), tile_slot_ptr, pairs_ptr,
                                      BLOCK_M, GROUP_M)
    if slot < S:
        m_mask = pair < num_pairs
        rows = (pair // K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + rows[:, None] * stride_x + offs_k[None, :]
        g_ptrs = w_ptr + slot * stride_ws + offs_n[None, :] * stride_wr + offs_k[:, None]      # [BLOCK_K, BLOCK_N]
        u_ptrs = g_ptrs + I * stride_wr
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = offs_k < H - k0
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            gate = mma(a, tl.load(g_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0), gate,
                       PRECISION, UPCAST)
            up = mma(a, tl.load(u_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0), up, PRECISION, UPCAST)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :],
                 h.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemm2_weighted_kernel(a_ptr, w_ptr, out_ptr, pairs_ptr, tile_slot_ptr, weights_ptr, num_pairs, num_tiles, S,
                           H, I, stride_a, stride_ws, stride_wr, stride_o,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[r, j] = weight[pair] * (a[r] . down_j) for sorted row r, fp32; w `[S, H, I]`."""
    pid_n, slot, offs_m, pair = _tile(tl.program_id(0), num_tiles, tl.cdiv(H, BLOCK_N), tile_slot_ptr, pairs_ptr,
                                      BLOCK_M, GROUP_M)
    if slot < S:
        m_mask = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)
        rows = offs_m.to(tl.int64)
        a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
        w_ptrs = w_ptr + slot * stride_ws + offs_n[None, :] * stride_wr + offs_k[:, None]       # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_mask = offs_k < I - k0
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = mma(a, tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0), acc, PRECISION, UPCAST)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        weight = tl.load(weights_ptr + pair, mask=m_mask, other=0.0)
        tl.store(out_ptr + rows[:, None] * stride_o + offs_n[None, :], acc * weight[:, None],
                 mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_choices_kernel(y_ptr, pos_ptr, out_ptr, H, stride_y, stride_o, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[n] = sum over k of y[pos[n, k]] (choices on other ranks, pos -1, add nothing), in choice order."""
    n = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(K):
        pos = tl.zeros([BLOCK_H], tl.int64) + tl.load(pos_ptr + n * K + k)    # a vector: the mask needs one
        acc += tl.load(y_ptr + pos * stride_y + offs, mask=mask & (pos >= 0), other=0.0)
    tl.store(out_ptr + n.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_tiles(num_pairs: int, num_slots: int, dtype: torch.dtype) -> dict:
    """Tile sizes from shapes alone (no sync): the tile height follows the mean pairs per slot; fp32 takes
    smaller tiles (larger ones spill registers, as `python -m kernels.aot` reads from the sm_90 compiler)."""
    per_slot = num_pairs / max(num_slots, 1)
    block_m = 16 if per_slot <= 16 else 32 if per_slot <= 32 else 64 if per_slot <= 512 else 128
    if dtype.itemsize == 4:
        return {"BLOCK_M": min(block_m, 32), "BLOCK_N1": 32, "BLOCK_N2": 64, "BLOCK_K": 32, "GROUP_M": 1,
                "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": block_m, "BLOCK_N1": 64, "BLOCK_N2": 128 if block_m >= 64 else 64, "BLOCK_K": 64,
            "GROUP_M": 1 if block_m <= 32 else 8, "num_warps": 4 if block_m <= 64 else 8, "num_stages": 3}


def fused_moe(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor) -> torch.Tensor:
    """x `[N, H]`, slots `[N, K]` int64 (-1 = elsewhere), weights `[N, K]` fp32, w13 `[S, 2I, H]`, w2 `[S, H, I]`
    -> `[N, H]` in x.dtype: sum_k weights[n, k] * FFN_{slots[n, k]}(x[n])."""
    N, H = x.shape
    out = torch.empty_like(x)
    if N == 0:
        return out
    interpreted = check_launch(_gemm1_swiglu_kernel, "fused_moe", x, slots, weights, w13, w2)
    float_dtype_ok("fused_moe", x)
    S, two_i, _ = w13.shape
    I, K = two_i // 2, slots.shape[1]
    if w13.shape != (S, 2 * I, H) or w2.shape != (S, H, I) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} {w13.dtype} / w2 {tuple(w2.shape)} {w2.dtype} do not "
                         f"match x {tuple(x.shape)} {x.dtype}: want w13 [S, 2I, H], w2 [S, H, I] in x's dtype")
    x, w13, w2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13, w2))
    weights = weights.to(torch.float32).contiguous()
    tiles = moe_tiles(N * K, S, x.dtype)
    bm, bk, group = tiles["BLOCK_M"], tiles["BLOCK_K"], tiles["GROUP_M"]
    launch = {"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"], **mma_flags(x.dtype, interpreted)}
    align = moe_align(slots, S, bm)
    T = align.num_tiles
    inter = torch.empty(T * bm, I, dtype=x.dtype, device=x.device)
    bn1 = tiles["BLOCK_N1"]
    _gemm1_swiglu_kernel[(T * triton.cdiv(I, bn1),)](
        x, w13, inter, align.sorted_pairs, align.tile_slot, N * K, T, S, H, I,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        K=K, BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk, GROUP_M=group, **launch)
    y = torch.empty(T * bm, H, dtype=torch.float32, device=x.device)
    bn2 = tiles["BLOCK_N2"]
    _gemm2_weighted_kernel[(T * triton.cdiv(H, bn2),)](
        inter, w2, y, align.sorted_pairs, align.tile_slot, weights, N * K, T, S, H, I,
        inter.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk, GROUP_M=group, **launch)
    block_h = min(1024, triton.next_power_of_2(H))
    _sum_choices_kernel[(N, triton.cdiv(H, block_h))](y, align.pair_pos, out, H, y.stride(0), out.stride(0),
                                                      K=K, BLOCK_H=block_h, num_warps=4)
    return out
