"""Speculative decoding's draft model (speculative_config method "draft_model"): a small dense checkpoint with the
target's vocabulary, run whole on every attention rank.

Why there: a draft small enough to pay for itself is a few MB, and its k forwards per step are latency-bound. On
the attention rank they cost no network hop, they see the rank's own sequences, and they need nothing of the expert
ranks, whose dispatch protocol stays one exchange per MoE layer of the target. A draft with MoE layers would need
its experts here too: it is refused (make it dense, e.g. a Qwen3-MoE config whose mlp_only_layers are all layers).

Its KV cache mirrors the target's block ids: a position the target keeps in block b, the draft keeps in its own
block b (a separate tensor). Only full blocks are shared that way: their tokens never change, and a full block that
several sequences share (the prefix cache, forked samples) holds the same tokens for each. The partly filled tail
of a sequence, and the positions its drafts reach, go to scratch blocks past the target's, handed out per call, so
each call recomputes the tail (at most block_size - 1 positions plus the drafts). `Sequence.draft_computed` counts
the leading positions whose draft KV is in full blocks; a sequence that is new, preempted, forked or handed over
starts from 0 and is recomputed.

A call proposes up to k tokens for each sequence: the first forward runs each one's positions from draft_computed
to its last token and takes the argmax of the last row; each next forward runs the previous draft as one decode
row. The drafts are deterministic (q one-hot), which `spec_decode.verify` takes as exact for sampled requests too.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from comm.stats import CommStats
from comm.sync_audit import host_read

from .batch import ForwardBatch
from .kv_cache import KVCache
from .model import AttentionModel
from .scheduler import ScheduledSeq
from .sequence import Sequence


@dataclass(slots=True)
class _View:
    """What the batch builder reads of a sequence: its tokens (with the drafts so far) and the draft's table."""
    token_ids: list[int]
    block_table: list[int]
    num_prompt_tokens: int
    prompt_logprobs: None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        return range(0)


class DraftModel:
    def __init__(self, model: AttentionModel, num_blocks: int, block_size: int, max_num_seqs: int, k: int,
                 dtype: torch.dtype, device: torch.device):
        spec = model.spec
        if spec.num_moe_layers:
            raise ValueError(f"the draft model has {spec.num_moe_layers} MoE layers: pass a dense one (every layer "
                             f"an MLP, e.g. a Qwen3-MoE config with mlp_only_layers listing all its layers)")
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        # scratch per sequence: the tail block, and the blocks k more positions reach
        self.num_scratch = max_num_seqs * (k // block_size + 2)
        self.kv = KVCache(spec.num_layers, num_blocks + self.num_scratch, block_size, spec.kv_entry, dtype, device)
        self.moe = SimpleNamespace(dispatcher=SimpleNamespace(stats=CommStats()))   # it never reaches an expert

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Up to rooms[i] (>= 1) greedy draft tokens for seqs[i], from its tokens so far."""
        bs = self.block_size
        scratch = iter(range(self.num_blocks, self.num_blocks + self.num_scratch))
        views, starts = [], []
        for seq, room in zip(seqs, rooms):
            n = seq.num_tokens
            full = min((n - 1) // bs, len(seq.block_table))      # blocks wholly before the last token's
            seq.draft_computed = min(seq.draft_computed, full * bs)
            table = seq.block_table[:full]
            table += [next(scratch) for _ in range(-(-(n + room - 1) // bs) - full)]
            views.append(_View(list(seq.token_ids), table, seq.num_prompt_tokens))
            starts.append(seq.draft_computed)
            seq.draft_computed = full * bs
        drafts: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for j in range(max(rooms)):
            rows = [ScheduledSeq(views[i], views[i].num_tokens - starts[i] if j == 0 else 1,
                                 starts[i] if j == 0 else views[i].num_tokens - 1) for i in active]
            order = sorted(range(len(rows)), key=lambda r: rows[r].num_new_tokens != 1)   # decodes first
            batch = ForwardBatch.from_scheduled([rows[r] for r in order], bs, self.model.device,
                                                self.model.kernel_backend)
            logits = self.model.forward([batch], self.kv, self.moe)
            picked = host_read(logits.argmax(dim=-1))
            for r, tok in zip(order, picked):
                i = active[r]
                drafts[i].append(tok)
                views[i].token_ids.append(tok)
            active = [i for i in active if len(drafts[i]) < rooms[i]]
            if not active:
                break
        return drafts

