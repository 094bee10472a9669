"""InputBatch: the per-sequence state one attention rank keeps across steps to build each step's ForwardBatch.

`ForwardBatch.from_scheduled` builds a batch from the sequences' Python lists: every block table copied and padded,
one host-to-device copy per field. Here each live sequence owns a row of a persistent block-table array, and a
step writes only what changed since the row was last written: the blocks appended (usually none, or one every
block_size decode steps), or the whole row when the table changed otherwise (copy on write at its tail, prefix-cache
admission, preemption), which `Sequence.block_table_version` tells. Positions, slots and the block tables of the
step are computed from those rows with a few vectorised array ops, staged into one int32 buffer (pinned on CUDA) and
moved to the device in one non-blocking copy; the int64 fields are widened there.

Each row also holds its sequence's sampling parameters (temperature, top_k, top_p, min_p), written once when the row
is handed out (on CUDA, copied to a device table then); a step that samples at random gathers its rows from that
table by row number (`sampling_columns`), staged like the inputs, instead of building the columns from the requests.

Rows are handed out on first sight of a sequence and taken back lazily: when none is free, rows whose sequence has
finished go back; if none has, the array doubles. `clear` drops every row (the rank handed its sequences over).
The staging buffer is reused from step to step (`begin_step`): a batch's tensors, views of it on the CPU, are only
valid until the next step begins. On CUDA its copies to the device are queued, not done, when `prepare` returns: an
event recorded after them is waited for before the next step rewrites the buffer. A step that samples reads its ids
back after its forward, so the wait is over by then; one that samples nothing (prompt chunks only) reads nothing
back, and without the event the host could rewrite the buffer before the stream had copied it.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.ops import plan_decode_attention

from .batch import DecodeMeta, ForwardBatch, PrefillMeta
from .sampler import SamplingColumns
from .sequence import Sequence
from .spec_decode import DeviceDrafts, place_drafts
from .step_plan import ScheduledSeq

_TOP_K_CAP = 2**24     # top_k is kept as a float32 column: larger values (all act as the vocabulary) are capped


class InputBatch:
    def __init__(self, block_size: int, num_blocks: int, max_model_len: int, device: torch.device, rows: int = 64,
                 copy_event=None):
        """copy_event: what marks the staging buffer's copies done (record after them, synchronize before reuse):
        a CUDA event by default on CUDA, none on the CPU (its copies are done when they return)."""
        if num_blocks * block_size >= 2**31:
            raise ValueError(f"{num_blocks} KV blocks of {block_size} tokens: slot numbers overflow int32; use a "
                             f"smaller KV cache per attention rank (at most {2**31 // block_size - 1} blocks)")
        self.block_size = block_size
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._tables = self._host((max(rows, 1), -(-max_model_len // block_size)), fill=-1)
        self._tables_np = self._tables.numpy()
        self._row: dict[Sequence, int] = {}        # a live sequence -> its row (identity: Sequence has eq=False)
        self._written = [0] * self._tables.shape[0]      # table entries written per row
        self._version = [-1] * self._tables.shape[0]     # the sequence's block_table_version they were written at
        self._free = list(range(self._tables.shape[0] - 1, -1, -1))
        self._sampling, self._sampling_np, self._sampling_dev = self._sampling_table(self._tables.shape[0])
        self._stage = self._host((4096,))
        self._stage_np = self._stage.numpy()
        self._used = 0
        self._copied = copy_event if copy_event is not None else torch.cuda.Event() if self._pin else None
        self._copy_pending = False
        self.num_row_writes = 0                          # (partial) row writes so far: what a step changed

    def _host(self, shape: tuple[int, ...], fill: int = 0) -> torch.Tensor:
        return torch.full(shape, fill, dtype=torch.int32, pin_memory=self._pin)

    def _sampling_table(self, rows: int) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """`[rows, 4]` float32 (temperature, top_k, top_p, min_p) on the host, its numpy view, and its device copy
        (the host table itself on the CPU)."""
        host = torch.zeros((rows, 4), dtype=torch.float32, pin_memory=self._pin)
        dev = host if self.device.type == "cpu" else host.to(self.device)
        return host, host.numpy(), dev

    @property
    def num_rows(self) -> int:
        """Rows held by sequences."""
        return len(self._row)

    @property
    def capacity(self) -> int:
        """Rows allocated."""
        return self._tables.shape[0]

    def begin_step(self) -> None:
        """A new step: its batches are staged from the start of the buffer again, once the last step's copies out
        of it have run (the module docstring)."""
        if self._copy_pending:
            self._copied.synchronize()
            self._copy_pending = False
        self._used = 0

    def clear(self) -> None:
        """Forget every sequence (their rows are free again)."""
        for r in self._row.values():
            self._release(r)
        self._row.clear()

    def table_row(self, seq: Sequence) -> torch.Tensor:
        """seq's row as written (-1 past its blocks): for tests and checks."""
        return self._tables[self._row[seq]]

    def prepare(self, scheduled: list[ScheduledSeq], kernel_backend: str = "torch") -> ForwardBatch:
        """The ForwardBatch of `scheduled` (ordered decodes first), as `ForwardBatch.from_scheduled` builds it."""
        if not scheduled:
            return ForwardBatch.empty(self.device)
        bs = self.block_size
        rows, starts, counts, ids, logit_rows = [], [], [], [], []
        on_device = []     # (position in ids, DeviceDrafts): drafts that go into the ids on the device
        num_decodes = total = 0
        for s in scheduled:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            if s.drafts:          # a draft chunk runs as 1 + d decode rows of one sequence (see ForwardBatch)
                row = self._sync(seq)
                rows += [row] * n
                starts.extend(range(start, start + n))
                counts += [1] * n
                ids.extend(s.input_ids())
                if isinstance(s.drafts, DeviceDrafts):
                    on_device.append((len(ids) - len(s.drafts), s.drafts))
                if num_decodes == len(rows) - n:
                    num_decodes += n
                total += n
                logit_rows.extend(range(total - n, total))
                continue
            rows.append(self._sync(seq))
            starts.append(start)
            counts.append(n)
            if n == 1:
                ids.append(seq.token_ids[start])
                if num_decodes == len(rows) - 1:
                    num_decodes += 1
            else:
                ids.extend(s.input_ids())
            if seq.prompt_logprobs is not None:
                logit_rows.extend(total + p - start for p in seq.prompt_logprob_positions(start, start + n))
            total += n
            if s.needs_sample:     # the last row; with drafts, every draft's row before it too
                logit_rows.extend(range(total - 1 - len(s.drafts), total))
        rows_np, starts_np = np.asarray(rows), np.asarray(starts)
        counts_np = np.asarray(counts)
        ends = starts_np + counts_np
        if total == len(rows):                # every row one token: no expansion needed
            req, pos = rows_np, starts_np
        else:
            req = np.repeat(rows_np, counts_np)
            pos = np.arange(total) + np.repeat(starts_np - (np.cumsum(counts_np) - counts_np), counts_np)
        slots = self._tables_np[req, pos // bs] * bs + pos % bs
        nd, npre = num_decodes, len(rows) - num_decodes
        dec_w = -(-int(ends[:nd].max()) // bs) if nd else 0
        pre_w = -(-int(ends[nd:].max()) // bs) if npre else 0
        cu = np.zeros(npre + 1, dtype=np.int64)
        np.cumsum(counts_np[nd:], out=cu[1:])
        parts = [ids, pos, slots, logit_rows, ends[:nd], self._tables_np[rows_np[:nd], :dec_w].ravel(), cu,
                 ends[nd:], self._tables_np[rows_np[nd:], :pre_w].ravel()]
        sizes = [len(p) for p in parts]
        first = self._staged(sum(sizes))
        at = first
        for p, n in zip(parts, sizes):
            self._stage_np[at:at + n] = p
            at += n
        staged = self._upload(first, at - first)
        views = staged.split(sizes)
        v_ids, v_pos, v_slots, v_logits, v_dlens, v_dtab, v_cu, v_plens, v_ptab = views
        decode = prefill = None
        if nd:
            dec_lens = ends[:nd].tolist()
            tables = v_dtab.view(nd, dec_w)
            decode = DecodeMeta(tables, v_dlens, max(dec_lens),
                                plan_decode_attention(tables, v_dlens, bs, kernel_backend, dec_lens))
        if npre:
            prefill = PrefillMeta(v_ptab.view(npre, pre_w), v_cu, v_plens, cu.tolist(), ends[nd:].tolist())
        input_ids = v_ids.long()
        if on_device:
            place_drafts(input_ids, on_device, self._index)
        graphable = nd == total and logit_rows == list(range(total))
        return ForwardBatch(input_ids, v_pos.long(), v_slots.long(), nd, decode, prefill, v_logits.long(), graphable)

    def _index(self, values: list[int]) -> torch.Tensor:
        """An int64 index on the device, staged like the step's inputs (one non-blocking copy)."""
        first = self._staged(len(values))
        self._stage_np[first:first + len(values)] = values
        return self._upload(first, len(values)).long()

    def sampling_columns(self, seqs: list[Sequence]) -> SamplingColumns | None:
        """The sampling parameters of seqs (one per logit row of the step's draw) gathered from their rows on the
        device, or None when every one is greedy (the sampler then draws nothing). A sequence without a row yet
        (a sample forked this step) gets one. Call after this step's `prepare`s: the row numbers are staged after
        theirs and go to the device in one non-blocking copy."""
        if all(seq.params.is_greedy for seq in seqs):
            return None
        rows = [self._sync(seq) for seq in seqs]
        first = self._staged(len(rows))
        self._stage_np[first:first + len(rows)] = rows
        index = self._upload(first, len(rows))
        picked = self._sampling_dev.index_select(0, index)
        return SamplingColumns(picked[:, 0], picked[:, 1].long(), picked[:, 2], picked[:, 3])

    def _upload(self, first: int, n: int) -> torch.Tensor:
        """Staging entries [first, first + n) on the device (one non-blocking copy, marked by copy_event)."""
        out = self._stage[first:first + n].to(self.device, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._copy_pending = True
        return out

    def _staged(self, n: int) -> int:
        """Where the next n entries of the staging buffer start (grown, never shrunk, when a step needs more)."""
        if self._used + n > self._stage.numel():
            # Batches staged earlier this step keep the old buffer alive through their views.
            self._stage = self._host((max(2 * self._stage.numel(), self._used + n),))
            self._stage_np = self._stage.numpy()
        first = self._used
        self._used += n
        return first

    def _sync(self, seq: Sequence) -> int:
        """seq's row, with what changed in its block table since the last write written -> the row."""
        r = self._row.get(seq)
        if r is None:
            r = self._row[seq] = self._take()
            p = seq.params
            self._sampling_np[r] = (p.temperature, min(p.top_k, _TOP_K_CAP), p.top_p, p.min_p)
            if self._sampling_dev is not self._sampling:
                # Stream-ordered before any draw that reads it; the host row is rewritten only once the row is free
                # again, after a later step's sampled ids were read back (so after this copy ran).
                self._sampling_dev[r].copy_(self._sampling[r], non_blocking=True)
        table, written = seq.block_table, self._written[r]
        n = len(table)
        if n > self._tables_np.shape[1]:
            self._grow(cols=n)
        if self._version[r] != seq.block_table_version or n < written:
            row = self._tables_np[r]
            row[:n] = table
            row[n:written] = -1
            self._version[r] = seq.block_table_version
            self.num_row_writes += 1
        elif n > written:
            self._tables_np[r, written:n] = table[written:]
            self.num_row_writes += 1
        self._written[r] = n
        return r

    def _take(self) -> int:
        if not self._free:
            for seq, r in list(self._row.items()):
                if seq.is_finished:
                    del self._row[seq]
                    self._release(r)
        if not self._free:
            self._grow(rows=2 * self._tables.shape[0])
        return self._free.pop()

    def _release(self, r: int) -> None:
        self._tables_np[r, :self._written[r]] = -1
        self._written[r], self._version[r] = 0, -1
        self._free.append(r)

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        old = self._tables
        R, C = max(rows, old.shape[0]), max(cols, old.shape[1])
        self._tables = self._host((R, C), fill=-1)
        self._tables[:old.shape[0], :old.shape[1]] = old
        self._tables_np = self._tables.numpy()
        extra = R - old.shape[0]
        if extra:
            old_host = self._sampling
            self._sampling, self._sampling_np, self._sampling_dev = self._sampling_table(R)
            self._sampling[:old.shape[0]] = old_host
            if self._sampling_dev is not self._sampling:
                self._sampling_dev.copy_(self._sampling)
        self._written += [0] * extra
        self._version += [-1] * extra
        self._free[:0] = range(R - 1, old.shape[0] - 1, -1)
