"""Paged attention over a block-table KV cache: torch reference.

Names: T query tokens in the batch, B sequences, h query heads, g = h / kvh query heads per
KV head, d head dim, N cache blocks, bs block size, M max blocks per sequence.
Cache layout per layer: k_cache, v_cache `[N, bs, kvh, d]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values. k, v: `[T, kvh, d]`; slot_mapping: `[T]` int64 flat slot = block * bs + offset."""
    N, bs, kvh, d = k_cache.shape
    k_cache.view(N * bs, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(N * bs, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[B, Q, h, d]`, k/v `[B, kvh, L, d]`, mask `[B, Q, L]` bool (True = attend) -> `[B, Q, h, d]`."""
    B, Q, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qg = q.view(B, Q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * Q, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale                       # [B, kvh, g*Q, L]
    scores = scores.view(B, kvh, g, Q, -1).masked_fill_(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(B, kvh, g * Q, -1)
    out = torch.matmul(probs, v)                                                 # [B, kvh, g*Q, d]
    return out.view(B, kvh, g, Q, d).permute(0, 3, 1, 2, 4).reshape(B, Q, h, d)


def _rows(block_table: torch.Tensor, bs: int) -> torch.Tensor:
    """block_table `[B, M]` (-1 padded) -> the flat cache rows `[B * M * bs]` those blocks cover."""
    return (block_table.clamp(min=0)[:, :, None] * bs + torch.arange(bs, device=block_table.device)).view(-1)


def _gather(cache: torch.Tensor, rows: torch.Tensor, B: int) -> torch.Tensor:
    """cache `[N, bs, kvh, d]`, rows `[B * L]` flat cache rows -> `[B, kvh, L, d]` contiguous."""
    N, bs, kvh, d = cache.shape
    out = cache.view(N * bs, kvh, d).index_select(0, rows)   # index_select: far cheaper than cache[table]
    return out.view(B, -1, kvh, d).transpose(1, 2).contiguous()


@dataclass(slots=True)
class DecodeGroup:
    """Up to `group` sequences of similar length: their rows in the batch (None = all, in order), the cache
    rows to gather `[G * L]` and the mask `[G, 1, L]`."""

    index: torch.Tensor | None
    rows: torch.Tensor
    mask: torch.Tensor


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                group: int = 16) -> list[DecodeGroup]:
    """Work out once per step what every layer's decode attention gathers (the tables are the same in
    every layer). Sequences are sorted by length and taken `group` at a time, each group gathering only up
    to its own longest context (with mixed lengths, one padded gather reads mostly padding)."""
    num_seqs = block_tables.shape[0]
    if num_seqs == 0:
        return []

    def make(index, tables, lens):
        pos = torch.arange(tables.shape[1] * block_size, device=tables.device)
        return DecodeGroup(index, _rows(tables, block_size), (pos[None, :] < lens[:, None])[:, None, :])

    if num_seqs <= group:
        return [make(None, block_tables, context_lens)]
    lens_sorted, order = torch.sort(context_lens)
    plan = []
    for start in range(0, num_seqs, group):
        idx = order[start:start + group]
        num_blocks = -(-int(lens_sorted[min(start + group, num_seqs) - 1]) // block_size)
        plan.append(make(idx, block_tables[idx, :num_blocks], context_lens[idx]))
    return plan


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           plan: list[DecodeGroup], scale: float) -> torch.Tensor:
    """One query per sequence. q `[B, h, d]`, plan from `plan_decode` -> `[B, h, d]`."""
    if len(plan) == 1 and plan[0].index is None:
        return _decode_group(q, k_cache, v_cache, plan[0], scale)
    out = torch.empty_like(q)
    for grp in plan:
        out[grp.index] = _decode_group(q[grp.index], k_cache, v_cache, grp, scale)
    return out


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, group: int = 16) -> torch.Tensor:
    """One query per sequence. q `[B, h, d]`; block_tables `[B, M]` int64; context_lens `[B]` -> `[B, h, d]`."""
    plan = plan_decode(block_tables, context_lens, k_cache.shape[1], group)
    return paged_attention_decode(q, k_cache, v_cache, plan, scale)


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, grp: DecodeGroup,
                  scale: float) -> torch.Tensor:
    k = _gather(k_cache, grp.rows, grp.mask.shape[0])
    v = _gather(v_cache, grp.rows, grp.mask.shape[0])
    return _attend(q[:, None], k, v, grp.mask, scale)[:, 0]


def paged_attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """One sequence's chunk of Q queries, the last Q of its context_len tokens.

    q `[Q, h, d]`; block_table `[M]` int64 -> `[Q, h, d]`. Causal within the chunk.
    """
    Q = q.shape[0]
    rows = _rows(block_table[None], k_cache.shape[1])[:context_len]
    k = _gather(k_cache, rows, 1)
    v = _gather(v_cache, rows, 1)
    q_pos = torch.arange(context_len - Q, context_len, device=q.device)
    mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
    return _attend(q[None], k, v, mask[None], scale)[0]
