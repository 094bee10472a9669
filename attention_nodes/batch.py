"""ForwardBatch: the flat token batch one attention rank runs in a step.

Names: T tokens, B decode rows, P prefill sequences, M max blocks per sequence. Decodes (one new token) come
first, prefill chunks follow; the attention metadata of both is built once per step. A speculative draft chunk (a
sequence's last token and its drafts, attention_nodes/speculation.py) runs as decode rows, one per token, each
with the context up to its own position: every token's KV is written before a layer attends, so row j sees the
drafts before it, and the whole chunk goes through the paged decode kernel instead of the prefill path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ops import plan_decode_attention
from kernels.paged_attention import DecodeGroup

from .spec_decode import DeviceDrafts, place_drafts
from .step_plan import ScheduledSeq, SchedulerOutput


@dataclass(slots=True)
class DecodeMeta:
    """The decode rows' attention inputs, the same in every layer."""

    block_tables: torch.Tensor          # [B, M] int32, -1 padded
    context_lens: torch.Tensor          # [B] int32, counting the token being decoded
    max_context_len: int                # host-side bound on context_lens: sizes the Triton grid without a sync
    plan: list[DecodeGroup] | None      # torch backend: the gathers each layer makes; None for Triton


@dataclass(slots=True)
class PrefillMeta:
    """The prefill chunks' attention inputs: chunk i is rows num_decodes + cu_seqlens_q[i] onwards."""

    block_tables: torch.Tensor          # [P, M] int32, -1 padded
    cu_seqlens_q: torch.Tensor          # [P+1] int32, counted from the first prefill row
    context_lens: torch.Tensor          # [P] int32, the cached prefix plus the chunk
    host_cu_seqlens: list[int]          # cu_seqlens_q and context_lens as host lists: the per-chunk loops of the
    host_context_lens: list[int]        # CPU paths read these instead of the device tensors


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    slot_mapping: torch.Tensor   # [T] int64 flat cache slot (block * block_size + offset) of each new token
    num_decodes: int             # the first num_decodes tokens are one-token decodes
    decode: DecodeMeta | None    # None when num_decodes == 0
    prefill: PrefillMeta | None  # None when every token is a decode
    logit_rows: torch.Tensor    # [S] int64 rows whose logits are computed: per sequence in order, its prompt
                                 # logprob rows (if asked for), then its sampled row (if it samples)
    graphable: bool = False      # decode rows only, each row's logits once in order: decode graphs can run it

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def empty(cls, device: torch.device) -> ForwardBatch:
        z = torch.empty(0, dtype=torch.int64, device=device)
        return cls(z, z, z, 0, None, None, z)

    @classmethod
    def from_scheduled(cls, scheduled: list[ScheduledSeq], block_size: int, device: torch.device,
                       kernel_backend: str = "torch") -> ForwardBatch:
        """scheduled must be ordered decodes first (see `order_for_batch`); kernel_backend: the resolved backend
        ("triton" or "torch") whose metadata to build."""
        if not scheduled:
            return cls.empty(device)
        ids, pos, slots, logit_rows = [], [], [], []
        on_device = []     # (position in ids, DeviceDrafts)
        dec_tables, dec_lens, pre_tables, pre_lens, cu = [], [], [], [], [0]
        num_decodes = 0
        row = 0
        for s in scheduled:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            end = start + n
            ids.extend(s.input_ids())
            if isinstance(s.drafts, DeviceDrafts):
                on_device.append((len(ids) - len(s.drafts), s.drafts))
            pos.extend(range(start, end))
            table = seq.block_table
            if n == 1:
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                slots.extend(table[i // block_size] * block_size + i % block_size for i in range(start, end))
            if (n == 1 or s.drafts) and not pre_tables:   # a draft chunk: a decode row per token, each seeing
                num_decodes += n                           # the positions up to its own
                dec_tables += [table] * n
                dec_lens.extend(range(start + 1, end + 1))
            elif s.drafts:                                 # after a prefill chunk: a one-token chunk per token
                pre_tables += [table] * n
                pre_lens.extend(range(start + 1, end + 1))
                cu.extend(range(cu[-1] + 1, cu[-1] + n + 1))
            else:
                pre_tables.append(table)
                pre_lens.append(end)
                cu.append(cu[-1] + n)
            logit_rows.extend(row + p - start for p in seq.prompt_logprob_positions(start, end))
            row += n
            if s.needs_sample:
                logit_rows.extend(range(row - 1 - len(s.drafts), row))

        def tensor(x, dtype=torch.int64):
            return torch.tensor(x, dtype=dtype, device=device)

        decode, prefill = attention_metadata(dec_tables, dec_lens, pre_tables, pre_lens, cu, block_size,
                                             kernel_backend, device)
        input_ids = tensor(ids)
        if on_device:
            place_drafts(input_ids, on_device, tensor)
        return cls(input_ids, tensor(pos), tensor(slots), num_decodes, decode, prefill, tensor(logit_rows))


def attention_metadata(dec_tables: list[list[int]], dec_lens: list[int], pre_tables: list[list[int]],
                       pre_lens: list[int], cu: list[int], block_size: int, kernel_backend: str, device: torch.device
                       ) -> tuple[DecodeMeta | None, PrefillMeta | None]:
    """The attention inputs of a batch built from host lists: decode rows (block table and context length each)
    and prefill chunks (block table, context length, cu_seqlens from 0); None for a part with no rows."""
    def tensor(x):
        return torch.tensor(x, dtype=torch.int32, device=device)
    decode = prefill = None
    if dec_tables:
        tables, lens = padded_tables(dec_tables, device), tensor(dec_lens)
        decode = DecodeMeta(tables, lens, max(dec_lens),
                            plan_decode_attention(tables, lens, block_size, kernel_backend, dec_lens))
    if pre_tables:
        prefill = PrefillMeta(padded_tables(pre_tables, device), tensor(cu), tensor(pre_lens), cu, pre_lens)
    return decode, prefill


def padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables of several sequences (or rows) -> `[n, M]` int32 on device, -1 padded."""
    M = max(len(t) for t in tables)
    return torch.tensor([t + [-1] * (M - len(t)) for t in tables], dtype=torch.int32, device=device)


def split_micro_batches(scheduled: list[ScheduledSeq], num: int) -> list[list[ScheduledSeq]]:
    """Cut the (ordered) schedule into `num` contiguous parts of equal token counts; parts may be empty. A prompt
    chunk that straddles a boundary is cut in two there: the first piece ends its part (it samples nothing), the
    second opens the next (a chunk carrying speculative drafts is never cut: all its rows are sampled). That is
    exact because micro-batch j runs each layer's attention, writing its KV, before
    micro-batch j + 1 runs that layer's, so the second piece reads the first's KV from the cache. Without the cut a
    step of decodes and one long prompt chunk would put the chunk alone in one micro-batch, and the expert ranks'
    work on it could not overlap the attention rank's. Single-token rows are never cut; one that straddles goes to
    the part holding its token."""
    total = sum(s.num_new_tokens for s in scheduled)
    parts: list[list[ScheduledSeq]] = [[] for _ in range(num)]
    done = part = 0
    for s in scheduled:
        start, left = s.start, s.num_new_tokens
        while left:
            while part < num - 1 and done >= total * (part + 1) // num:
                part += 1
            room = total * (part + 1) // num - done
            take = left if left == 1 or s.drafts or part == num - 1 or room >= left else room
            parts[part].append(s if take == s.num_new_tokens else
                               ScheduledSeq(s.seq, take, start, s.is_fork))
            start, left, done = start + take, left - take, done + take
    return parts


def order_for_batch(out: SchedulerOutput) -> SchedulerOutput:
    """Stable reorder: single-token steps and draft chunks first (they batch as decode rows), then multi-token
    chunks."""
    out.scheduled.sort(key=lambda s: s.num_new_tokens != 1 and not s.drafts)
    return out
