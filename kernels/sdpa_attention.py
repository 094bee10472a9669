"""Paged attention on `torch.nn.functional.scaled_dot_product_attention`: the fast path where Triton does not run
(the CPU). The references in paged_attention.py stay the oracle; these give the same results to fp32 rounding.

Decode: sequences of similar length are taken a group at a time (`plan_decode`), their blocks are gathered whole
(one index_select per cache, one contiguous block per index) and one fused SDPA call attends every head of the
group, grouped-query heads included (`enable_gqa`). Prefill: one SDPA call per chunk over its gathered prefix
with the offset-causal mask. GPT-OSS's sinks are not an SDPA input: calls with sinks take the reference.
Names as in paged_attention.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .paged_attention import (
    DecodeGroup,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    plan_decode,
    prefill_chunks,
    widen,
)

DECODE_GROUP = 8   # sequences per decode gather: measured fastest on a 2-core CPU at 64 sequences of 16-400 tokens


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           plan: list[DecodeGroup] | None = None, sinks: torch.Tensor | None = None,
                           window: int | None = None) -> torch.Tensor:
    """As `paged_decode_attention_ref`: q `[B, h, d]` -> `[B, h, dv]`."""
    if sinks is not None:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, plan, sinks, window)
    if plan is None:
        plan = plan_decode(block_tables, context_lens, k_cache.shape[1], DECODE_GROUP)
    if len(plan) == 1 and plan[0].index is None:
        return _decode_group(q, k_cache, v_cache, plan[0], scale, window)
    out = q.new_empty(*q.shape[:2], v_cache.shape[-1])
    for grp in plan:
        out[grp.index] = _decode_group(q[grp.index], k_cache, v_cache, grp, scale, window)
    return out


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, grp: DecodeGroup, scale: float,
                  window: int | None) -> torch.Tensor:
    N, bs, kvh, d = k_cache.shape
    G, h, _ = q.shape
    k = widen(k_cache.view(N, bs * kvh * d).index_select(0, grp.blocks).view(G, -1, kvh, d).transpose(1, 2), q.dtype)
    v = k if v_cache is k_cache else \
        widen(v_cache.view(N, bs * kvh * d).index_select(0, grp.blocks).view(G, -1, kvh, d).transpose(1, 2), q.dtype)
    keep = grp.mask                                                      # [G, 1, L]
    if window is not None:
        pos = torch.arange(keep.shape[-1], device=keep.device)
        keep = keep & (pos[None, :] >= grp.lens[:, None] - window)[:, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keep[:, None], scale=scale,
                                         enable_gqa=kvh != h)            # [G, h, 1, dv]
    return out[:, :, 0]


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, sinks: torch.Tensor | None = None, window: int | None = None, *,
                            host_cu_seqlens: list[int] | None = None,
                            host_context_lens: list[int] | None = None) -> torch.Tensor:
    """As `paged_prefill_attention_ref`: q `[T, h, d]` -> `[T, h, dv]`, causal. host_cu_seqlens /
    host_context_lens: the same values as host lists, when the caller has them (no device read then)."""
    if sinks is not None:
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                           sinks, window)
    starts = cu_seqlens_q.tolist() if host_cu_seqlens is None else host_cu_seqlens
    lens = context_lens.tolist() if host_context_lens is None else host_context_lens
    out = q.new_empty(*q.shape[:2], v_cache.shape[-1])
    kvh, h = k_cache.shape[2], q.shape[1]
    for start, end, k, v, mask in prefill_chunks(k_cache, v_cache, block_tables, starts, lens, window, q.dtype):
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=kvh != h)          # [1, h, Q, dv]
        out[start:end] = o[0].transpose(0, 1)
    return out
