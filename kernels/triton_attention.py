"""Triton kernels for the paged KV cache: KV write, split-KV decode attention, prefill over a cached prefix.

Names: T query tokens, B sequences, P prefill sequences, h query heads, kvh KV heads, g = h / kvh, d head
dim, N cache blocks, bs block size, M max blocks per sequence. Cache `[N, bs, kvh, d]`, d contiguous.
Scores are kept in base 2 (exp2 with the scale folded by log2 e), accumulated in fp32.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .paged_attention import to_kv
from .triton_common import check_launch, float_dtype_ok, mma, mma_flags

LOG2E = 1.4426950408889634
MIN_PARTITION = 256     # fewest KV tokens worth a decode partition of their own


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v, stride_kc, stride_vc,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    """One program per token: copy its `[kvh * d]` row of K and of V to its cache slot (-1 = skip)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
        tl.store(kc_ptr + slot * stride_kc + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * stride_vc + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v `[T, kvh, d]` into k_cache, v_cache `[N, bs, kvh, d]` at slot_mapping `[T]` (-1 = skip)."""
    T = k.shape[0]
    if T == 0:
        return
    check_launch(_write_kv_kernel, "write_kv", k_cache, v_cache, k, v, slot_mapping)
    N, bs, kvh, d = k_cache.shape
    # cast here, not in the kernel: a float8 cache gets to_kv's saturating cast (the interpreter's differs)
    k, v = to_kv(k.reshape(T, kvh * d), k_cache.dtype), to_kv(v.reshape(T, kvh * d), v_cache.dtype)
    kc, vc = _slot_rows(k_cache, "k_cache"), _slot_rows(v_cache, "v_cache")
    _write_kv_kernel[(T,)](k, v, kc, vc, slot_mapping, k.stride(0), v.stride(0), kc.stride(0), vc.stride(0),
                           ROW=kvh * d, BLOCK=triton.next_power_of_2(kvh * d))


def _slot_rows(cache: torch.Tensor, name: str) -> torch.Tensor:
    """`[N, bs, kvh, d]` -> a `[N * bs, kvh * d]` view; each block's rows must be dense."""
    N, bs, kvh, d = cache.shape
    if cache.stride()[1:] != (kvh * d, d, 1):
        raise ValueError(f"{name} strides {cache.stride()} are not dense within a block; pass a cache whose "
                         f"[bs, kvh, d] part is contiguous")
    return cache.as_strided((N * bs, kvh * d), (kvh * d, 1))


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, toks, t_mask, allowed, kh, qk_scale, offs_d, d_mask,
                 stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
                 BS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One online-softmax step: queries q `[ROWS, BLOCK_D]` against KV head kh of tokens toks `[BLOCK_N]` (t_mask:
    the real ones), found through the sequence's block table at table_ptr; allowed `[ROWS, BLOCK_N]` masks the
    scores (a row may have no allowed key in a tile). -> (m_i, l_i, acc)."""
    blk = tl.load(table_ptr + toks // BS, mask=t_mask, other=0).to(tl.int64)
    off = toks % BS
    k = tl.load(k_ptr + (blk * stride_kn + off * stride_kb + kh * stride_kh)[None, :] + offs_d[:, None],
                mask=d_mask[:, None] & t_mask[None, :], other=0.0).to(q.dtype)               # [BLOCK_D, BLOCK_N]
    s = mma(q, k, tl.zeros([ROWS, BLOCK_N], tl.float32), PRECISION, UPCAST) * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key allowed yet (sliding window)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(v_ptr + (blk * stride_vn + off * stride_vb + kh * stride_vh)[:, None] + offs_d[None, :],
                mask=t_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)               # [BLOCK_N, BLOCK_D]
    acc = mma(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                         qk_scale, stride_qb, stride_qh, stride_kn, stride_kb, stride_kh, stride_vn, stride_vb,
                         stride_vh, stride_bt, stride_ob, stride_oh, part_size, num_parts, H, window,
                         G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
                         HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Program (b, kv head, partition): the g query heads of that KV head over KV tokens
    [p * part_size, (p + 1) * part_size) of sequence b, from its window's first token on (NO_WINDOW: all).
    SINGLE: one partition, write the output itself (with the heads' sinks in the denominator); else write the
    partition's normalised output `[B, h, P, d]` fp32 and log2-sum-exp `[B, h, P]`."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    p = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    start = tl.maximum(p * part_size, ctx - window)
    end = tl.minimum(p * part_size + part_size, ctx)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kh * G + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + offs_n
        t_mask = toks < end
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + b * stride_bt, toks, t_mask,
                                     t_mask[None, :], kh, qk_scale, offs_d, d_mask, stride_kn, stride_kb, stride_kh,
                                     stride_vn, stride_vb, stride_vh, BS, BLOCK_G, BLOCK_N, PRECISION, UPCAST)
    denom = l_i
    if SINGLE and HAS_SINKS:   # the sink joins the normalisation: exp(sink - max), in the log2 domain
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        denom = l_i + tl.exp2(sink - tl.where(m_i == float("-inf"), sink, m_i)) * tl.where(l_i > 0, 1.0, 0.0)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]   # an empty partition (ctx 0) stays zero
    mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (b * H + heads) * num_parts + p
        tl.store(part_out_ptr + row[:, None] * D + offs_d[None, :], out, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, lens_ptr, sinks_ptr, out_ptr, stride_ob, stride_oh,
                          part_size, num_parts, H, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                          HAS_SINKS: tl.constexpr):
    """Program (b, head): merge the partitions of sequence b that hold tokens, weighted by their sums (plus
    the head's sink in the denominator)."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < (ctx + part_size - 1) // part_size
    d_mask = offs_d < D
    row = (b * H + hq) * num_parts + offs_p
    lse = tl.load(part_lse_ptr + row, mask=p_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o = tl.load(part_out_ptr + row[:, None] * D + offs_d[None, :], mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + hq).to(tl.float32) * 1.4426950408889634
        denom += tl.where(top == float("-inf"), 0.0, tl.exp2(sink - tl.where(top == float("-inf"), 0.0, top)))
    out = tl.sum(o * w[:, None], 0) / tl.maximum(denom, 1e-30)
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def decode_partitions(batch: int, kv_heads: int, max_context_len: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """(partitions, tokens per partition) for split-KV decode: enough programs to fill the GPU about four times
    over, but no partition under MIN_PARTITION tokens (nor under one tile)."""
    want = -(-4 * num_sms // max(1, batch * kv_heads))
    parts = max(1, min(want, -(-max_context_len // MIN_PARTITION)))
    size = block_n * max(1, -(-max_context_len // (parts * block_n)))
    return -(-max(max_context_len, 1) // size), size


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context_len: int | None = None, partition_size: int | None = None, *,
                           sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q `[B, h, d]`, block_tables `[B, M]`, context_lens `[B]` -> `[B, h, d]`. max_context_len: a host-side
    bound on context_lens that sizes the grid (default M * bs: no device sync either way); partition_size
    overrides the split (tests use it to force several partitions); sinks `[h]`, window: see kernels.ops."""
    B, h, d = q.shape
    N, bs, kvh, _ = k_cache.shape
    out = torch.empty_like(q)
    if B == 0:
        return out
    q, interpreted = _checked(_decode_split_kernel, "paged_decode_attention", q, k_cache, v_cache, block_tables,
                              context_lens)
    max_ctx = block_tables.shape[1] * bs if max_context_len is None else max_context_len
    block_n = _tile(d, q.dtype)
    if partition_size is None:
        num_parts, part = decode_partitions(B, kvh, max_ctx, block_n, _num_sms(q.device))
    else:
        part = partition_size
        num_parts = -(-max(max_ctx, 1) // part)
    g = h // kvh
    single = num_parts == 1
    part_out = part_lse = out   # unused placeholders when single
    if not single:
        part_out = torch.empty(B, h, num_parts, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, h, num_parts, dtype=torch.float32, device=q.device)
    sink_arg = _sinks_arg(sinks, h, q)
    _decode_split_kernel[(B, kvh, num_parts)](
        q, k_cache, v_cache, block_tables, context_lens, sink_arg, out, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), part, num_parts, h, window or NO_WINDOW,
        G=g, D=d, BS=bs, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=block_n, SINGLE=single, HAS_SINKS=sinks is not None, **mma_flags(q.dtype, interpreted),
        num_warps=4, num_stages=3)
    if not single:
        _decode_reduce_kernel[(B, h)](part_out, part_lse, context_lens, sink_arg, out, out.stride(0), out.stride(1),
                                      part, num_parts, h, D=d, BLOCK_P=triton.next_power_of_2(num_parts),
                                      BLOCK_D=triton.next_power_of_2(d), HAS_SINKS=sinks is not None, num_warps=4)
    return out


NO_WINDOW = 1 << 30   # full attention: a window longer than any context


def _sinks_arg(sinks: torch.Tensor | None, h: int, q: torch.Tensor) -> torch.Tensor:
    """The sinks pointer argument: `[h]` fp32 on q's device, or q itself as an unused placeholder."""
    if sinks is None:
        return q
    if sinks.shape != (h,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}, expected ({h},): one logit per query head")
    return sinks.to(device=q.device, dtype=torch.float32).contiguous()


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_ptr, lens_ptr, sinks_ptr, qk_scale,
                    stride_qt, stride_qh, stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
                    stride_ot, stride_oh, stride_bt, num_seqs, window,
                    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Program (tile, query head). Sequence s owns tiles [cu[s] // BLOCK_M + s, cu[s+1] // BLOCK_M + s + 1),
    enough for its ceil(q_len / BLOCK_M) query tiles; a binary search finds s, spare tiles exit."""
    pid = tl.program_id(0)
    hq = tl.program_id(1)
    # Step 1: the sequence and query tile of this program.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_M + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    s = lo - 1
    q_start = tl.load(cu_ptr + s)
    q_len = tl.load(cu_ptr + s + 1) - q_start
    tile = pid - (q_start // BLOCK_M + s)
    if tile * BLOCK_M < q_len:
        # Step 2: online softmax over the keys this tile's queries may see (its last query's causal bound).
        ctx = tl.load(lens_ptr + s)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < q_len
        d_mask = offs_d < D
        q_pos = ctx - q_len + offs_m
        kh = hq // G
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + hq * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
        begin = 0
        if HAS_WINDOW:   # the tile's first query sees back to its position - window + 1: start at that key tile
            begin = (tl.maximum(ctx - q_len + tile * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
        for n0 in range(begin, end, BLOCK_N):
            toks = n0 + offs_n
            t_mask = toks < end
            causal = (toks[None, :] <= q_pos[:, None]) & t_mask[None, :]
            if HAS_WINDOW:
                causal = causal & (toks[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + s * stride_bt, toks, t_mask,
                                         causal, kh, qk_scale, offs_d, d_mask, stride_kn, stride_kb, stride_kh,
                                         stride_vn, stride_vb, stride_vh, BS, BLOCK_M, BLOCK_N, PRECISION, UPCAST)
        denom = tl.where(l_i > 0, l_i, 1.0)   # padding rows past the chunk may see no key in a window
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + hq).to(tl.float32) * 1.4426950408889634
            denom = l_i + tl.exp2(sink - tl.where(m_i == float("-inf"), sink, m_i))
        out = acc / denom[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + hq * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, *, sinks: torch.Tensor | None = None,
                            window: int | None = None) -> torch.Tensor:
    """q `[T, h, d]`, block_tables `[P, M]`, cu_seqlens_q `[P+1]`, context_lens `[P]` -> `[T, h, d]`, causal over
    each sequence's cached prefix and its new tokens; sinks `[h]`, window: see kernels.ops."""
    T, h, d = q.shape
    N, bs, kvh, _ = k_cache.shape
    P = block_tables.shape[0]
    out = torch.empty_like(q)
    if T == 0 or P == 0:
        return out
    q, interpreted = _checked(_prefill_kernel, "paged_prefill_attention", q, k_cache, v_cache, block_tables,
                              cu_seqlens_q, context_lens)
    block_m = _tile(d, q.dtype)
    _prefill_kernel[(T // block_m + P, h)](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, _sinks_arg(sinks, h, q), scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        block_tables.stride(0), P, window or NO_WINDOW,
        G=h // kvh, D=d, BS=bs, BLOCK_M=block_m, BLOCK_N=block_m, BLOCK_D=triton.next_power_of_2(d),
        HAS_SINKS=sinks is not None, HAS_WINDOW=window is not None, **mma_flags(q.dtype, interpreted),
        num_warps=4, num_stages=3)
    return out


def _tile(d: int, dtype: torch.dtype) -> int:
    """Tile edge (KV tokens; prefill queries too): 64; 16 where 64 and 32 spill registers (fp32, d > 128), as
    `python -m kernels.aot` reads from the sm_90 compiler."""
    return 64 if d <= 128 and dtype.itemsize == 2 else 16


def _checked(kernel, name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             *meta: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The attention wrappers' input checks -> (q with a contiguous head dim, whether the kernel runs
    interpreted)."""
    interpreted = check_launch(kernel, name, q, k_cache, v_cache, *meta)
    float_dtype_ok(name, q)
    h, d, kvh = q.shape[-2], q.shape[-1], k_cache.shape[2]
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} KV heads")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} do not hold head dim {d}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dim must be contiguous")
    return (q if q.stride(-1) == 1 else q.contiguous()), interpreted
