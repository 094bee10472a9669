"""Speculative decoding's draft model (speculative_config method "draft_model"): a small dense checkpoint with the
target's vocabulary, run whole on every attention rank.

Why there: a draft small enough to pay for itself is a few MB, and its k forwards per step are latency-bound. On
the attention rank they cost no network hop, they see the rank's own sequences, and they need nothing of the expert
ranks, whose dispatch protocol stays one exchange per MoE layer of the target. A draft with MoE layers would need
its experts here too: it is refused (make it dense, e.g. a Qwen3-MoE config whose mlp_only_layers are all layers).

Its KV cache mirrors the target's block ids: a position the target keeps in block b, the draft keeps in its own
block b (a separate tensor). That holds for full blocks (their tokens never change, and a full block several
sequences share, through the prefix cache or forked samples, holds the same tokens for each) and for the block of
a sequence's last token when the sequence alone holds it. A tail block shared with forked samples (each puts its
own token there until the target copies it on write), and the positions the drafts reach past the target's
blocks, go to scratch blocks past the target's, handed out per call and recomputed by the next.
`Sequence.draft_computed` counts the leading positions whose draft KV is in the target's blocks; a sequence that
is new, preempted, forked or handed over starts from 0 and is recomputed (a new one from its whole prompt).

A call proposes up to k tokens for each sequence: the first forward runs each one's positions from draft_computed
to its last token and takes the argmax of the last row; each next forward runs the previous draft. Every position
runs as a decode row (each seeing the positions up to its own), so all go through the paged decode kernel. The
drafts are deterministic (q one-hot), which `spec_decode.verify` takes as exact for sampled requests too.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from comm.stats import CommStats

from .batch import ForwardBatch, attention_metadata
from .kv_cache import KVCache
from .model import AttentionModel
from .sequence import Sequence
from .speculation import scratch_blocks


@dataclass(slots=True)
class _View:
    """A sequence as the draft runs it: its tokens (with the drafts so far) and the draft's block table."""
    token_ids: list[int]
    block_table: list[int]


class DraftModel:
    def __init__(self, model: AttentionModel, num_blocks: int, block_size: int, max_num_seqs: int, k: int,
                 dtype: torch.dtype, device: torch.device, exclusive=lambda block: False):
        """exclusive(block): only one sequence holds the target's block (the block pool's refcount is 1)."""
        spec = model.spec
        if spec.num_moe_layers:
            raise ValueError(f"the draft model has {spec.num_moe_layers} MoE layers: pass a dense one (every layer "
                             f"an MLP, e.g. a Qwen3-MoE config with mlp_only_layers listing all its layers)")
        self.model, self.block_size, self.num_blocks, self.exclusive = model, block_size, num_blocks, exclusive
        self.num_scratch = scratch_blocks(max_num_seqs, k, block_size)
        self.kv = KVCache(spec.num_layers, num_blocks + self.num_scratch, block_size, spec.kv_entry, dtype, device)
        self.moe = SimpleNamespace(dispatcher=SimpleNamespace(stats=CommStats()))   # it never reaches an expert

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> torch.Tensor:
        """Greedy draft tokens for each of seqs, from its tokens so far -> `[len(seqs), max(rooms)]` int64 on the
        device: row i's first rooms[i] (>= 1) are seqs[i]'s. Each forward's argmax feeds the next on the device,
        and nothing is read back (verification reads them, spec_decode.DeviceDrafts)."""
        bs, k = self.block_size, max(rooms)
        scratch = iter(range(self.num_blocks, self.num_blocks + self.num_scratch))
        views, starts = [], []
        for seq in seqs:
            n = seq.num_tokens
            full = min((n - 1) // bs, len(seq.block_table))      # blocks wholly before the last token's
            # the last token's block is the target's too when the sequence alone holds it (a forked sample's
            # shared tail holds another sample's token at the same position until it is copied on write)
            own = full < len(seq.block_table) and self.exclusive(seq.block_table[full])
            kept = full + own
            seq.draft_computed = min(seq.draft_computed, kept * bs)
            table = seq.block_table[:kept]
            table += [next(scratch) for _ in range(-(-(n + k - 1) // bs) - kept)]
            views.append(_View(seq.token_ids, table))
            starts.append(min(seq.draft_computed, n - 1))     # the last token always runs: its row drafts
            seq.draft_computed = n if own else full * bs
        picked = []
        for j in range(k):
            batch = self._rows(views, starts) if j == 0 else self._next_rows(views, j, picked[-1])
            picked.append(self.model.forward([batch], self.kv, self.moe).argmax(dim=-1))
        return torch.stack(picked, dim=1)

    def _next_rows(self, views: list[_View], j: int, ids: torch.Tensor) -> ForwardBatch:
        """Draft j of every view (its position: the last token's + j) as one decode row each, its id the argmax
        of the forward before (`ids`, on the device)."""
        bs = self.block_size
        pos = [len(v.token_ids) - 1 + j for v in views]
        slots = [v.block_table[p // bs] * bs + p % bs for v, p in zip(views, pos)]
        return self._rows_of([v.block_table for v in views], pos, slots, ids)

    def _rows(self, views: list[_View], begin: list[int]) -> ForwardBatch:
        """Positions begin[i] .. the last of views[i] as decode rows (each seeing the positions up to its own;
        every row's KV is written before a layer attends), the logits of each view's last row."""
        bs = self.block_size
        ids, pos, slots, tables, last = [], [], [], [], []
        for v, b in zip(views, begin):
            for p in range(b, len(v.token_ids)):
                ids.append(v.token_ids[p])
                pos.append(p)
                slots.append(v.block_table[p // bs] * bs + p % bs)
                tables.append(v.block_table)
            last.append(len(ids) - 1)
        return self._rows_of(tables, pos, slots, torch.tensor(ids, dtype=torch.int64, device=self.model.device),
                             last)

    def _rows_of(self, tables: list[list[int]], pos: list[int], slots: list[int], ids: torch.Tensor,
                 last: list[int] | None = None) -> ForwardBatch:
        """A batch of decode rows: row r at position pos[r] over block table tables[r], the logits of rows `last`
        (default: every row)."""
        dev = self.model.device
        decode, _ = attention_metadata(tables, [p + 1 for p in pos], [], [], [0], self.block_size,
                                       self.model.kernel_backend, dev)

        def tensor(x):
            return torch.tensor(x, dtype=torch.int64, device=dev)
        return ForwardBatch(ids, tensor(pos), tensor(slots), len(pos), decode, None,
                            tensor(list(range(len(pos))) if last is None else last))
