"""Paged attention over a block-table KV cache: torch references (the CPU path and the kernels' oracle).

Names: T query tokens in the batch, B sequences, h query heads, kvh KV heads, g = h / kvh query heads
per KV head, d head dim, N cache blocks, bs block size, M max blocks per sequence.
Cache layout per layer: k_cache, v_cache `[N, bs, kvh, d]`. A cache may hold float8 (`kv_cache_dtype`, e4m3 or
e5m2, no scale: vLLM's default where a checkpoint has none): keys and values are cast to it as they are written
(`to_kv`: clamped to the format's largest finite value, as vLLM's kernels saturate, then torch's rounding cast)
and cast back to the query's dtype as they are read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of dtype stores it: a float8 cast saturates at the format's largest finite value (torch's own
    cast gives inf for e5m2, and NaN for e4m3 before torch 2.12, past it). A NaN (a broken forward's) stays NaN,
    which the backends then read differently (Triton as NaN; `widen` and the C decode's e4m3 as 480)."""
    if dtype in FP8_DTYPES:
        top = torch.finfo(dtype).max
        x = x.clamp(-top, top)
    return x.to(dtype)


def widen(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values read from a cache, in dtype. e4m3 on the CPU goes through fp16, exactly (its exponent and
    mantissa bits moved into fp16's places read as 2^-8 of its value, subnormals too): ~3x faster than torch's own
    CPU cast from e4m3 (measured); its NaN pattern reads as 480 (`to_kv`)."""
    if t.dtype != torch.float8_e4m3fn or t.device.type != "cpu":
        return t.to(dtype)
    b = t.view(torch.uint8).to(torch.int16)
    return (((b & 0x7F) << 7) | ((b & 0x80) << 8)).view(torch.float16).to(dtype) * 256


def kv_bits(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as uint8 (torch's CPU index_copy_ has no float8 kernel); any other as it is."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, may_skip: bool = True) -> None:
    """Store new keys/values. k, v: `[T, kvh, d]`; slot_mapping: `[T]` int64 flat slot = block * bs + offset,
    -1 = skip this token (padding). may_skip=False: the caller knows no slot is -1 (the engine's batches), so
    nothing is checked (the check reads a value back from the device)."""
    N, bs, kvh, d = k_cache.shape
    keep = slot_mapping >= 0
    if may_skip and not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    kv_bits(k_cache.view(N * bs, kvh, d)).index_copy_(0, slot_mapping, kv_bits(to_kv(k, k_cache.dtype)))
    kv_bits(v_cache.view(N * bs, kvh, d)).index_copy_(0, slot_mapping, kv_bits(to_kv(v, v_cache.dtype)))


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim in fp32. sinks: one logit per row (broadcast to scores[..., :1]) that joins
    the normalisation but attends to nothing (GPT-OSS's learned attention sinks)."""
    if sinks is None:
        return torch.softmax(scores.float(), dim=-1)
    full = torch.cat((scores.float(), sinks.float().expand_as(scores[..., :1])), dim=-1)
    return torch.softmax(full, dim=-1)[..., :-1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q `[B, Q, h, d]`, k/v `[B, kvh, L, d]`, mask `[B, Q, L]` bool (True = attend), sinks `[h]` or None ->
    `[B, Q, h, d]`."""
    B, Q, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qg = q.view(B, Q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * Q, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale                       # [B, kvh, g*Q, L]
    scores = scores.view(B, kvh, g, Q, -1).masked_fill_(~mask[:, None, None], float("-inf"))
    sink = None if sinks is None else sinks.view(1, kvh, g, 1, 1)
    probs = _softmax(scores, sink).to(q.dtype).view(B, kvh, g * Q, -1)
    out = torch.matmul(probs, v)                                                 # [B, kvh, g*Q, dv]
    dv = v.shape[-1]
    return out.view(B, kvh, g, Q, dv).permute(0, 3, 1, 2, 4).reshape(B, Q, h, dv)


def _rows(block_table: torch.Tensor, bs: int) -> torch.Tensor:
    """block_table `[B, M]` (-1 padded) -> the flat cache rows `[B * M * bs]` those blocks cover."""
    table = block_table.long().clamp(min=0)
    return (table[:, :, None] * bs + torch.arange(bs, device=block_table.device)).view(-1)


def _gather(cache: torch.Tensor, rows: torch.Tensor, B: int) -> torch.Tensor:
    """cache `[N, bs, kvh, d]`, rows `[B * L]` flat cache rows -> `[B, kvh, L, d]` contiguous."""
    N, bs, kvh, d = cache.shape
    out = cache.view(N * bs, kvh, d).index_select(0, rows)   # index_select: far cheaper than cache[table]
    return out.view(B, -1, kvh, d).transpose(1, 2).contiguous()


@dataclass(slots=True)
class DecodeGroup:
    """Up to `group` sequences of similar length: their rows in the batch (None = all, in order), the cache
    blocks to gather `[G * M]` (-1 padding read as block 0, masked), the mask `[G, 1, M * bs]` and lengths."""

    index: torch.Tensor | None
    blocks: torch.Tensor
    mask: torch.Tensor
    lens: torch.Tensor      # [G] context lengths (a sliding window masks from lens - window)


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                group: int = 16, host_lens: list[int] | None = None) -> list[DecodeGroup]:
    """Work out once per step what every layer's decode attention gathers (the tables are the same in
    every layer). Sequences are sorted by length and taken `group` at a time, each group gathering only up
    to its own longest context (with mixed lengths, one padded gather reads mostly padding). host_lens: the
    context lengths as a host list, where the caller has them (then nothing is read back from the device)."""
    lens = context_lens.tolist() if host_lens is None else host_lens
    num_seqs = len(lens)
    if num_seqs == 0:
        return []
    device = block_tables.device
    if num_seqs <= group:
        return plan_dense(block_tables, context_lens, block_size)
    order = sorted(range(num_seqs), key=lens.__getitem__)
    plan = []
    for start in range(0, num_seqs, group):
        members = order[start:start + group]
        num_blocks = -(-lens[members[-1]] // block_size)
        idx = torch.tensor(members, dtype=torch.int64, device=device)
        plan.append(_group(idx, block_tables[idx, :num_blocks], context_lens[idx], block_size))
    return plan


def plan_dense(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> list[DecodeGroup]:
    """One group of every row, gathering every block of the tables' width: device ops only, nothing read from the
    host or frozen from it, so a CUDA graph captured once replays it for whatever tables and lengths it holds."""
    return [_group(None, block_tables, context_lens, block_size)]


def _group(index: torch.Tensor | None, tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> DecodeGroup:
    pos = torch.arange(tables.shape[1] * block_size, device=tables.device)
    return DecodeGroup(index, tables.long().clamp(min=0).reshape(-1), (pos[None, :] < lens[:, None])[:, None, :],
                       lens)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               plan: list[DecodeGroup] | None = None, sinks: torch.Tensor | None = None,
                               window: int | None = None) -> torch.Tensor:
    """One query per sequence. q `[B, h, d]`; block_tables `[B, M]` int32/int64, -1 padded; context_lens `[B]`
    (counting the token being decoded, already written) -> `[B, h, d]`. plan: `plan_decode` of the same
    tables, made once per step (made here when None). sinks `[h]`: per-head sink logits; window: the query
    sees only its last `window` positions (itself included)."""
    if plan is None:
        plan = plan_decode(block_tables, context_lens, k_cache.shape[1])
    if len(plan) == 1 and plan[0].index is None:
        return _decode_group(q, k_cache, v_cache, plan[0], scale, sinks, window)
    out = q.new_empty(*q.shape[:2], v_cache.shape[-1])
    for grp in plan:
        out[grp.index] = _decode_group(q[grp.index], k_cache, v_cache, grp, scale, sinks, window)
    return out


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, grp: DecodeGroup,
                  scale: float, sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q `[G, h, d]` -> `[G, h, dv]`. The group's blocks are copied whole (one contiguous block per index, not
    one token row) into `[G, L, kvh, d]`, and each KV head attends through strided batched matmuls, so the
    gathered K/V are never transposed into a second copy."""
    N, bs, kvh, d = k_cache.shape
    G, h, _ = q.shape
    g = h // kvh
    k = widen(k_cache.view(N, bs * kvh * d).index_select(0, grp.blocks).view(G, -1, kvh, d), q.dtype)
    # MLA passes its latent cache as both K and V: gather it once.
    v = k if v_cache is k_cache else \
        widen(v_cache.view(N, bs * kvh * d).index_select(0, grp.blocks).view(G, -1, kvh, d), q.dtype)
    keep = grp.mask                                                      # [G, 1, L]
    if window is not None:
        pos = torch.arange(keep.shape[-1], device=keep.device)
        keep = keep & (pos[None, :] >= grp.lens[:, None] - window)[:, None, :]
    out = q.new_empty(G, h, v.shape[-1])
    for j in range(kvh):
        qj = q[:, j * g:(j + 1) * g]                                     # [G, g, d]
        scores = torch.bmm(qj, k[:, :, j].transpose(1, 2)) * scale       # [G, g, L]
        scores = scores.masked_fill_(~keep, float("-inf"))
        sink = None if sinks is None else sinks[j * g:(j + 1) * g, None]
        probs = _softmax(scores, sink).to(q.dtype)
        out[:, j * g:(j + 1) * g] = torch.bmm(probs, v[:, :, j])         # [G, g, dv]
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, sinks: torch.Tensor | None = None,
                                window: int | None = None) -> torch.Tensor:
    """Prefill chunks over a cached prefix. q `[T, h, d]`: sequence i's queries are rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1], its last positions of context_lens[i] tokens (whose K/V are written);
    block_tables `[P, M]`; cu_seqlens_q `[P+1]`; context_lens `[P]` -> `[T, h, dv]`, causal; sinks and window
    as in the decode."""
    out = q.new_empty(*q.shape[:2], v_cache.shape[-1])
    for start, end, k, v, mask in prefill_chunks(k_cache, v_cache, block_tables, cu_seqlens_q.tolist(),
                                                 context_lens.tolist(), window, q.dtype):
        out[start:end] = _attend(q[None, start:end], k, v, mask[None], scale, sinks)[0]
    return out


def prefill_chunks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, starts: list[int],
                   lens: list[int], window: int | None, dtype: torch.dtype):
    """Per prefill chunk that has queries (host lists: starts = cu_seqlens_q, lens = context_lens) -> (start, end,
    its gathered prefix k and v `[1, kvh, L, d]` in dtype (the queries'), mask `[Q, L]` bool: offset-causal,
    within the window). Shared by the reference and the SDPA prefill."""
    bs = k_cache.shape[1]
    for i, ctx in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        Q = end - start
        if Q == 0:
            continue
        rows = _rows(block_tables[i:i + 1, :-(-ctx // bs)], bs)[:ctx]
        k = widen(_gather(k_cache, rows, 1), dtype)
        v = k if v_cache is k_cache else widen(_gather(v_cache, rows, 1), dtype)
        q_pos = torch.arange(ctx - Q, ctx, device=k_cache.device)
        k_pos = torch.arange(ctx, device=k_cache.device)[None, :]
        mask = k_pos <= q_pos[:, None]
        if window is not None:
            mask &= k_pos > q_pos[:, None] - window
        yield start, end, k, v, mask
