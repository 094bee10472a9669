"""ForwardBatch: the flat token batch one attention rank runs in a step.

Names: T tokens, B sequences, M max blocks per sequence. Decodes (one new token) come first so
the attention reference can batch them; prefill chunks follow, one sequence each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import DecodeGroup, plan_decode

from .scheduler import ScheduledSeq, SchedulerOutput


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    slot_mapping: torch.Tensor   # [T] int64 flat cache slot (block * block_size + offset) of each new token
    num_decodes: int             # the first num_decodes tokens are one-token decodes
    decode_plan: list[DecodeGroup]      # what each layer's decode attention gathers (same in every layer)
    prefills: list[tuple[int, int, torch.Tensor, int]]   # (first token row, num tokens, block table [m], context len)
    sample_rows: torch.Tensor    # [S] int64 rows whose logits are sampled

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def empty(cls, device: torch.device) -> ForwardBatch:
        z = torch.empty(0, dtype=torch.int64, device=device)
        return cls(z, z, z, 0, [], [], z)

    @classmethod
    def from_scheduled(cls, scheduled: list[ScheduledSeq], block_size: int, device: torch.device) -> ForwardBatch:
        """scheduled must be ordered decodes first (see `order_for_batch`)."""
        if not scheduled:
            return cls.empty(device)
        ids, pos, slots, sample_rows, prefills = [], [], [], [], []
        dec_tables, dec_lens = [], []
        num_decodes = 0
        row = 0
        for s in scheduled:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            table = seq.block_table
            if n == 1:
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                slots.extend(table[i // block_size] * block_size + i % block_size for i in range(start, end))
            if n == 1 and not prefills:
                num_decodes += 1
                dec_tables.append(table)
                dec_lens.append(end)
            else:
                prefills.append((row, n, torch.tensor(table, dtype=torch.int64, device=device), end))
            row += n
            if s.needs_sample:
                sample_rows.append(row - 1)
        M = max((len(t) for t in dec_tables), default=1)
        dec = torch.tensor([t + [-1] * (M - len(t)) for t in dec_tables], dtype=torch.int64).view(-1, M)

        def tensor(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(tensor(ids), tensor(pos), tensor(slots), num_decodes,
                   plan_decode(dec.to(device), tensor(dec_lens), block_size), prefills, tensor(sample_rows))


def split_micro_batches(scheduled: list[ScheduledSeq], num: int) -> list[list[ScheduledSeq]]:
    """Cut the (ordered) schedule into `num` contiguous parts of about equal token counts; parts may be empty."""
    total = sum(s.num_new_tokens for s in scheduled)
    parts: list[list[ScheduledSeq]] = [[] for _ in range(num)]
    done = 0
    for s in scheduled:
        part = min(num - 1, (2 * done + s.num_new_tokens) * num // max(2 * total, 1))  # by chunk midpoint
        parts[part].append(s)
        done += s.num_new_tokens
    return parts


def order_for_batch(out: SchedulerOutput) -> SchedulerOutput:
    """Stable reorder: single-token steps first (they batch), then multi-token chunks."""
    out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
    return out
