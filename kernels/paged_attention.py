"""Paged attention over a block-table KV cache: torch reference.

Names: T query tokens in the batch, B sequences, h query heads, g = h / kvh query heads per
KV head, d head dim, N cache blocks, bs block size, M max blocks per sequence.
Cache layout per layer: k_cache, v_cache `[N, bs, kvh, d]`.
"""
from __future__ import annotations

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


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache `[N, bs, kvh, d]`, block_table `[B, M]` (-1 padded) -> `[B, kvh, M * bs, d]` contiguous."""
    N, bs, kvh, d = cache.shape
    B, M = block_table.shape
    slots = (block_table.clamp(min=0)[:, :, None] * bs + torch.arange(bs, device=cache.device)).view(-1)
    rows = cache.view(N * bs, kvh, d).index_select(0, slots)   # index_select: far cheaper than cache[table]
    return rows.view(B, M * bs, kvh, d).transpose(1, 2).contiguous()


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, group: int = 16) -> torch.Tensor:
    """One query per sequence. q `[B, h, d]`; block_tables `[B, M]` int64; context_lens `[B]` -> `[B, h, d]`.

    Sequences are sorted by length and done `group` at a time, each group gathering only up to its own
    longest context (with mixed lengths, one padded gather reads mostly padding)."""
    num_seqs = q.shape[0]
    if num_seqs <= group:
        return _decode_group(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    lens_sorted, order = torch.sort(context_lens)
    for start in range(0, num_seqs, group):
        idx = order[start:start + group]
        num_blocks = -(-int(lens_sorted[min(start + group, num_seqs) - 1]) // bs)
        out[idx] = _decode_group(q[idx], k_cache, v_cache, block_tables[idx, :num_blocks], context_lens[idx], scale)
    return out


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    k = _gather(k_cache, block_tables)
    v = _gather(v_cache, block_tables)
    pos = torch.arange(k.shape[2], device=q.device)
    mask = (pos[None, :] < context_lens[:, None])[:, None, :]
    return _attend(q[:, None], k, v, mask, scale)[:, 0]


def paged_attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """One sequence's chunk of Q queries, the last Q of its context_len tokens.

    q `[Q, h, d]`; block_table `[M]` int64 -> `[Q, h, d]`. Causal within the chunk.
    """
    Q = q.shape[0]
    k = _gather(k_cache, block_table[None])[:, :, :context_len]
    v = _gather(v_cache, block_table[None])[:, :, :context_len]
    q_pos = torch.arange(context_len - Q, context_len, device=q.device)
    mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
    return _attend(q[None], k, v, mask[None], scale)[0]
