"""Speculative decoding with DeepSeek's multi-token-prediction layers (speculative_config method "mtp").

The layer (DeepSeek-V3 report, section 2.2; the release's `model.layers.{num_hidden_layers + i}`): at position p it
reads the target's final-normed hidden state h_p and the embedding of the next token t_{p+1},

    x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])
    y = DecoderLayer(x)                        # MLA attention over its own KV cache, then the MoE FFN
    logits = shared_head.head(shared_head.norm(y))   -> t_{p+2}

The embedding and head are the layer's own tensors where the checkpoint has them (the release stores copies of the
target's), else the target's. Its routed experts are MoE layer `num_moe_layers - num_mtp_layers + i` on the expert
ranks (ModelSpec.with_mtp), so every pass is one more dispatch and combine, which the step header announces
(`StepHeader.draft_passes`): each step, after verification, every attention rank runs k passes, with or without
rows, so the expert ranks serve k rounds of the MTP layer's MoE.

- Pass 1 runs, for every sequence the step advanced, the positions whose target hidden state the step computed and
  kept (its chunk, up to the last accepted token): t_{p+1} is known for each, and the KV they write in the MTP
  layer's cache is exact from then on (only positions up to the last accepted one are written in the target's
  blocks). A sequence's last such row gives its first draft.
- Pass j > 1 (vLLM's chaining, the same layer again; of several MTP layers only the first runs, ModelSpec.with_mtp):
  one row per drafting sequence at the next position, its input the previous draft and, standing in for the
  target hidden state not computed yet, the previous pass's output y. These positions are past the target's
  blocks: they go to scratch blocks (past the target's), and the next step's pass 1 writes them again from real
  hidden states.

The MTP cache mirrors the target's block ids (a position in target block b is in MTP block b), with the target's
copy-on-write copies applied to it too. What it does not follow: KV restored from the host tier or handed over from
another rank, a forked sample's prompt tail and a prefix-cache hit's last cached position (its MTP entry was
written with the next token of the sequence that computed it). There the MTP layer attends over stale entries:
drafts get worse, never the output, which verification decides.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .batch import ForwardBatch, attention_metadata
from .kv_cache import KVCache
from .model import AttentionModel, MoEContext, rms_norm
from .sequence import Sequence
from .spec_decode import DeviceDrafts
from .speculation import scratch_blocks
from .step_plan import ScheduledSeq


class _MTPCache(KVCache):
    """The MTP layers' KV cache, addressed by their decoder-layer numbers (num_layers + i)."""

    def __init__(self, first_layer: int, *args):
        super().__init__(*args)
        self.first_layer = first_layer

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        return super().layer(i - self.first_layer)


@dataclass(slots=True)
class _Rows:
    """One sequence's rows of pass 1: positions start .. start + count - 1, their target hidden states at rows
    hidden_at .. of the step's forward; room: how many drafts it wants (0: its rows only fill the cache);
    decode: a decode or draft chunk's rows (each runs as a decode row, as the target ran them), else a prompt
    chunk's (one prefill chunk)."""
    seq: Sequence
    start: int
    count: int
    hidden_at: int
    room: int
    decode: bool


class MTPProposer:
    def __init__(self, model: AttentionModel, num_blocks: int, block_size: int, max_num_seqs: int, k: int,
                 dtype: torch.dtype, device: torch.device, exclusive=lambda block: False):
        """model: the target's, holding the MTP layers' weights (ModelSpec.with_mtp). exclusive(block): only one
        sequence holds the target's block (the block pool's refcount is 1)."""
        spec = model.spec
        self.model, self.block_size, self.num_blocks, self.exclusive = model, block_size, num_blocks, exclusive
        self.first, self.n = spec.num_layers, spec.num_mtp_layers
        self.first_moe = spec.num_moe_layers - self.n
        self.num_scratch = scratch_blocks(max_num_seqs, k, block_size)
        self.kv = _MTPCache(self.first, self.n, num_blocks + self.num_scratch, block_size, spec.kv_entry, dtype,
                            device)
        w = model.w
        self.embed = [w.get(f"model.layers.{i}.embed_tokens.weight", w["model.embed_tokens.weight"])
                      for i in range(self.first, self.first + self.n)]
        self.head = [w.get(f"model.layers.{i}.shared_head.head.weight", model.lm_head)
                     for i in range(self.first, self.first + self.n)]
        model.keep_hidden = True

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The target's copy-on-write copies of this step, applied to the MTP cache too."""
        self.kv.copy_device_blocks(copies)

    def propose(self, scheduled: list[ScheduledSeq], emitted: list[list[int] | None], rooms: dict[int, int],
                passes: int, moe: MoEContext) -> None:
        """Run `passes` MTP passes after a step and set the drafts (seq.spec_tokens) of the sequences in rooms.
        scheduled: the step's chunks, in the order of the forward's rows (model.hidden); emitted: the tokens each
        emitted (None: a chunk that sampled nothing); rooms: id(seq) -> drafts it may take (>= 1); a sequence not in
        rooms gets none but still runs its pass-1 rows. Nothing is read back: the drafts stay on the device
        (spec_decode.DeviceDrafts) until the next step's verification."""
        entries, at = [], 0
        for s, toks in zip(scheduled, emitted):
            if not s.seq.is_finished and not s.is_fork:
                count = s.num_new_tokens if toks is None else s.num_new_tokens - len(s.drafts) - 1 + len(toks)
                entries.append(_Rows(s.seq, s.start, count, at, rooms.get(id(s.seq), 0),
                                     s.num_new_tokens == 1 or bool(s.drafts)))
            at += s.num_new_tokens
        drafting = [e for e in entries if e.room]
        hidden, picked, tables = self.model.hidden, [], None
        for j in range(passes):
            if j == 0:
                batch, prev = self._first_rows(entries) if entries else self._empty(hidden)
            elif j < max((e.room for e in drafting), default=0):
                tables = tables or self._chain_tables(drafting)
                batch, prev = self._next_rows(drafting, tables, j, picked[-1]), hidden
            else:
                batch, prev = self._empty(hidden)
            (logits, hidden), = self.model.run([self._layer(j, batch, prev)], moe)
            if batch.num_tokens:
                picked.append(logits.argmax(dim=-1))
        if drafting:
            values = torch.stack(picked, dim=1)                  # [len(drafting), passes used]
            for i, e in enumerate(drafting):
                e.seq.spec_tokens = DeviceDrafts(values, i, e.room)

    def join(self, passes: int, moe: MoEContext) -> None:
        """Join a step's MTP passes with no rows (a re-sent step this rank had finished)."""
        for j in range(passes):
            self.model.run([self._layer(j, *self._empty(None))], moe)

    def _layer(self, j: int, batch: ForwardBatch, prev: torch.Tensor):
        """Pass j over batch as a generator (AttentionModel.run drives it through the MoE exchange); prev: the
        hidden state each row reads `[T, H]` -> (the logits of batch.logit_rows, the layer's output at them)."""
        m, i = self.model, self.first + j % self.n
        s, p, w = m.spec, f"model.layers.{i}", m.w
        e = F.embedding(batch.input_ids, self.embed[j % self.n])
        x = torch.cat((rms_norm(e, w[f"{p}.enorm.weight"], s.rms_norm_eps),
                       rms_norm(prev.to(e.dtype), w[f"{p}.hnorm.weight"], s.rms_norm_eps)), dim=-1)
        h = F.linear(x, w[f"{p}.eh_proj.weight"])
        cos, sin = m.rope_tables(h, batch.positions)
        h, delta = yield from m.layer(i, self.first_moe + j % self.n, h, None, cos, sin, batch, self.kv)
        out = (h + delta)[batch.logit_rows]
        normed = rms_norm(out, w[f"{p}.shared_head.norm.weight"], s.rms_norm_eps)
        return F.linear(normed, self.head[j % self.n]).float(), out

    def _empty(self, hidden: torch.Tensor | None) -> tuple[ForwardBatch, torch.Tensor]:
        dev, H = self.model.device, self.model.spec.hidden_size
        dtype = self.kv.tensor.dtype if hidden is None else hidden.dtype
        return ForwardBatch.empty(dev), torch.empty(0, H, dtype=dtype, device=dev)

    def _first_rows(self, entries: list[_Rows]) -> tuple[ForwardBatch, torch.Tensor]:
        """Pass 1: decode entries as decode rows (one per position, each seeing the positions up to its own) first,
        then prompt chunks as prefill chunks; the logits of each drafting entry's last row."""
        bs, dev = self.block_size, self.model.device
        order = sorted(entries, key=lambda e: not (e.decode or e.count == 1))
        ids, pos, slots, rows, last = [], [], [], [], []
        dec_tables, dec_lens, pre_tables, pre_lens, cu = [], [], [], [], [0]
        for e in order:
            seq, table, end = e.seq, e.seq.block_table, e.start + e.count
            ids += seq.token_ids[e.start + 1:end + 1]
            pos += range(e.start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(e.start, end)]
            rows += range(e.hidden_at, e.hidden_at + e.count)
            if e.decode or e.count == 1:
                dec_tables += [table] * e.count
                dec_lens.extend(range(e.start + 1, end + 1))
            else:
                pre_tables.append(table)
                pre_lens.append(end)
                cu.append(cu[-1] + e.count)
            if e.room:
                last.append(len(ids) - 1)
        # logit rows in the order of the drafting entries as propose lists them (entries' order)
        by_entry = dict(zip(map(id, (e for e in order if e.room)), last))
        logit_rows = [by_entry[id(e)] for e in entries if e.room]

        def tensor(x):
            return torch.tensor(x, dtype=torch.int64, device=dev)
        decode, prefill = attention_metadata(dec_tables, dec_lens, pre_tables, pre_lens, cu, bs,
                                             self.model.kernel_backend, dev)
        batch = ForwardBatch(tensor(ids), tensor(pos), tensor(slots), len(dec_lens), decode, prefill,
                             tensor(logit_rows))
        return batch, self.model.hidden[tensor(rows)]

    def _chain_tables(self, drafting: list[_Rows]) -> list[list[int]]:
        """The block tables the passes after the first run over, once per step: positions past each entry's last
        accepted one go to scratch blocks, up to the largest room's passes; a tail block the sequence shares
        (forked samples) is copied there first, with the entries it holds."""
        bs = self.block_size
        scratch = iter(range(self.num_blocks, self.num_blocks + self.num_scratch))
        tables, copies = [], []
        reach = max(e.room for e in drafting) - 1       # every drafting row runs up to the largest room's passes
        for e in drafting:
            last = e.start + e.count - 1                 # the last accepted position: its block is the target's
            table = e.seq.block_table[:last // bs + 1]
            if (last + 1) % bs and not self.exclusive(table[-1]):
                copies.append((table[-1], next(scratch)))
                table = table[:-1] + [copies[-1][1]]
            table += [next(scratch) for _ in range((last + reach) // bs + 1 - len(table))]
            tables.append(table)
        self.kv.copy_device_blocks(copies)
        return tables

    def _next_rows(self, drafting: list[_Rows], tables: list[list[int]], j: int, ids: torch.Tensor) -> ForwardBatch:
        """Pass j + 1: one decode row per drafting entry at its last accepted position + j over its chain table,
        its input the previous draft (`ids`, on the device)."""
        bs, dev = self.block_size, self.model.device
        pos = [e.start + e.count - 1 + j for e in drafting]
        slots = [table[p // bs] * bs + p % bs for table, p in zip(tables, pos)]
        decode, _ = attention_metadata(tables, [p + 1 for p in pos], [], [], [0], bs, self.model.kernel_backend, dev)

        def tensor(x):
            return torch.tensor(x, dtype=torch.int64, device=dev)
        return ForwardBatch(ids, tensor(pos), tensor(slots), len(pos), decode, None, tensor(list(range(len(pos)))))
