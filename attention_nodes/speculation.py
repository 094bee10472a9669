"""Speculative decoding in the engine (issue 30): the configuration, the drafter that proposes each running
sequence's next tokens after a step, and the verification of a step's drafts into emitted tokens.

How a step verifies: a running sequence with d drafts is scheduled as one chunk of 1 + d tokens (its last token,
then the drafts), so attention and every MoE layer's dispatch and combine carry all of them in the one step
(attention_nodes/scheduler.py). The chunk's d + 1 rows are all sampled rows: row j scores the token after the
sequence's tokens plus drafts[:j]. Here those rows are shaped (penalties, bias, min_tokens see the drafts before
them as generated), and each request's tokens are emitted by `spec_decode.verify` (random requests: rejection
sampling, so the output follows the target's distribution) or `verify_greedy` (exactly the tokens without
speculation). The scheduler then appends what was emitted, stops at EOS, stop tokens, max_tokens and the context
limit, and rolls the sequence back past the rejected drafts: their KV slots are computed again next step, and the
blocks they alone needed go back to the pool.

The drafts of the next step are proposed right after a step (`Drafter.propose`), so that the step report's bound
on the next step's tokens counts them, and the leader sizes the next step's messages to fit.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from comm.sync_audit import host_read

from .logits_process import allowed_ids, shape_logits
from .sampler import Sampler, SamplingColumns, argmax_rows, fill_exponential
from .sequence import Sequence
from .spec_decode import DeviceDrafts, ngram_propose, place_drafts, verify, verify_greedy

METHODS = ("ngram", "draft_model", "mtp")
PLANNED = ("eagle",)   # vLLM's other method: refused by name until it is built
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
        "model")
MAX_SPECULATIVE_TOKENS = 16


def scratch_blocks(max_num_seqs: int, k: int, block_size: int) -> int:
    """A draft KV cache's blocks past the target's (the draft model's and the MTP layers'): per sequence, a copy of
    its tail block and the blocks k more positions reach."""
    return max_num_seqs * (k // block_size + 2)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's speculative_config keys. method "ngram": prompt lookup (no model); prompt_lookup_min/max bound the
    n-gram matched (vLLM's defaults: both 5 when neither is given, else the one given for both). method
    "draft_model": model, a local checkpoint directory of a small dense model with the target's vocabulary
    (attention_nodes/draft_model.py). method "mtp": the target checkpoint's own multi-token-prediction layers
    (DeepSeek-V3's release layout, attention_nodes/mtp.py).
    disable_by_batch_size: no drafts while this many sequences or more run on a rank (large batches gain little
    and pay for the rejected positions)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None
    model: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SpeculativeConfig | None:
        if d is None:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config={d!r} is invalid: pass a dict (JSON object) such as "
                             f'{{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}}')
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}: valid keys are {list(KEYS)}")
        method = d.get("method")
        if method in PLANNED:
            raise ValueError(f"speculative_config method={method!r} is not supported yet (issue 30): use "
                             f"method='ngram', 'draft_model' or 'mtp'")
        if method not in METHODS:
            raise ValueError(f"speculative_config method={method!r} is invalid: choose one of {list(METHODS)}")

        def count(name: str, value, lo: int, hi: int | None = None) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or hi is not None and value > hi:
                rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"speculative_config {name}={value!r} is invalid: pass an integer {rng}")
            return value

        k = count("num_speculative_tokens", d.get("num_speculative_tokens"), 1, MAX_SPECULATIVE_TOKENS)
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = count("prompt_lookup_min", hi if lo is None else lo, 1)
        hi = count("prompt_lookup_max", lo if hi is None else hi, 1)
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min={lo} > prompt_lookup_max={hi}: pass min <= max")
        off = d.get("disable_by_batch_size")
        model = d.get("model")
        if (method == "draft_model") != (model is not None):
            raise ValueError(f"speculative_config model={model!r} with method={method!r}: method 'draft_model' "
                             f"takes the draft's checkpoint directory as model, and only it does")
        if model is not None and not (isinstance(model, str) and os.path.isdir(model)):
            raise ValueError(f"speculative_config model={model!r} is not a directory: pass the draft model's local "
                             f"checkpoint directory")
        return cls(method, k, lo, hi, None if off is None else count("disable_by_batch_size", off, 1), model)


class Drafter:
    """Proposes a running sequence's drafts for its next step: prompt lookup over its prompt and output, or the
    draft model's greedy continuation (draft: its attention_nodes/draft_model.DraftModel). Method "mtp" proposes
    in the step's MTP passes instead (attention_nodes/mtp.py): `propose` only decides who drafts how many (`rooms`)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None):
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"method {config.method!r} with draft={draft!r}: a draft model is for 'draft_model'")
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.rooms: dict[int, int] = {}    # method "mtp": id(seq) -> drafts it may take, from the last propose
        self.off = False                   # the last propose found the rank at disable_by_batch_size

    def propose(self, seqs: list[Sequence], num_running: int) -> None:
        """Set each unfinished seq's spec_tokens: at most num_speculative_tokens, never more than the request
        may still emit (one token more comes from the target anyway) or the context holds; none while
        num_running reaches disable_by_batch_size."""
        c = self.config
        off = c.disable_by_batch_size is not None and num_running >= c.disable_by_batch_size
        todo, rooms = [], []
        self.rooms, self.off = {}, off
        for seq in seqs:
            if seq.is_finished:
                continue
            room = min(c.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens)
            seq.spec_tokens = []
            if off or room < 1:
                continue
            if c.method == "mtp":
                self.rooms[id(seq)] = room
            elif self.draft is None:
                seq.spec_tokens = ngram_propose(_tokens(seq), room, c.prompt_lookup_min, c.prompt_lookup_max).tolist()
            else:
                todo.append(seq)
                rooms.append(room)
        if todo:
            values = self.draft.propose(todo, rooms)
            for i, (seq, room) in enumerate(zip(todo, rooms)):
                seq.spec_tokens = DeviceDrafts(values, i, room)


def _tokens(seq: Sequence) -> np.ndarray:
    """seq.token_ids as an int64 array, from its token_array with what was appended since copied in (converting
    the whole list each step cost ~10 us per sequence of 250 tokens, more than the lookup itself)."""
    n = len(seq.token_ids)
    buf = seq.token_array
    done = 0 if buf is None else buf[1]
    if buf is None or n > len(buf[0]):
        grown = np.empty(max(2 * n, 64), dtype=np.int64)
        if buf is not None:
            grown[:done] = buf[0][:done]
        buf = (grown, done)
    if done < n:
        buf[0][done:n] = seq.token_ids[done:n]
    seq.token_array = (buf[0], n)
    return buf[0][:n]


@dataclass(slots=True)
class SpecStats:
    """Cumulative counts, vLLM's: drafts (sequences verified with at least one draft), draft tokens, accepted
    tokens, and accepted tokens per draft position."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_drafts: list[int], num_emitted: list[int]) -> None:
        for d, m in zip(num_drafts, num_emitted):
            if not d:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += d
            accepted = min(m - 1, d)
            self.num_accepted_tokens += accepted
            if len(self.accepted_per_position) < d:
                self.accepted_per_position += [0] * (d - len(self.accepted_per_position))
            for j in range(accepted):
                self.accepted_per_position[j] += 1

    def to_list(self) -> list[int]:
        """On the wire (StepReport.spec_decode): [drafts, draft tokens, accepted, accepted at position 0, 1, ...]."""
        return [self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, *self.accepted_per_position]


def summed(reports: list[list[int]]) -> dict:
    """Several ranks' StepReport.spec_decode lists -> llm.stats()["spec_decode"]."""
    total: list[int] = []
    for r in reports:
        total += [0] * (len(r) - len(total))
        for i, v in enumerate(r):
            total[i] += v
    total += [0] * (3 - len(total))
    return {"num_drafts": total[0], "num_draft_tokens": total[1], "num_accepted_tokens": total[2],
            "num_accepted_tokens_per_pos": total[3:]}


@dataclass(slots=True)
class Ahead:
    """A sequence as it would be after some of its drafts were emitted: what shape_logits reads of a sequence
    (allowed_ids: the sequence's, built once)."""
    params: object
    token_ids: list[int]
    num_prompt_tokens: int
    allowed_ids: torch.Tensor | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def emit(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], eos: frozenset[int],
         grammars=None) -> tuple[list[list[int]], list[int]]:
    """Verify one step's sampled rows -> (tokens emitted per sequence, the logit row of each one's first token).

    logits: `[R, V]` raw, R = sum(1 + len(d)): per sequence in order, its 1 + d rows. Everything runs on the
    device up to the step's one host read of the emitted tokens and their counts (device drafts are read earlier
    only for a request whose logits are shaped by the tokens before them: penalties, min_tokens, bad words, a
    grammar). grammars: the rank's structured.Grammars, when a sequence has structured outputs."""
    counts = [len(d) for d in drafts]
    first_rows = np.cumsum([0] + [1 + d for d in counts[:-1]]).tolist()
    shown = [d.read() if isinstance(d, DeviceDrafts) and s.params.reads_history else d for s, d in zip(seqs, drafts)]
    allowed = {id(s): allowed_ids(s, logits.shape[1], logits.device) for s, d in zip(seqs, shown)
               if d and s.params.reads_history and s.params.allowed_token_ids}
    views = [Ahead(s.params, s.token_ids + d[:j], s.num_prompt_tokens, allowed.get(id(s)))
             if j and s.params.reads_history else s for s, d in zip(seqs, shown) for j in range(len(d) + 1)]
    shaped = shape_logits(logits.float(), views, eos)
    if grammars is not None:
        grammars.mask_drafts(shaped, seqs, shown)
    B, k, dev = len(seqs), max(counts), logits.device
    # [B, k + 1] row of each position (positions past a request's drafts repeat its last row; they are not read)
    host_index = [[r + min(j, d) for j in range(k + 1)] for r, d in zip(first_rows, counts)]
    index = torch.tensor(host_index, dtype=torch.int64, device=dev)
    draft_t = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.int64, device=dev)
    on_device = [(b * k, d) for b, d in enumerate(drafts) if isinstance(d, DeviceDrafts) and d]
    if on_device:
        place_drafts(draft_t.view(-1), on_device, lambda x: torch.tensor(x, dtype=torch.int64, device=dev))
    num_t = torch.tensor(counts, dtype=torch.int64, device=dev)
    tokens, emitted = verify_greedy(argmax_rows(shaped)[index], draft_t, num_t)
    random = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
    if random:
        rows = torch.tensor(random, dtype=torch.int64, device=dev)
        params = [seqs[b].params for b in random for _ in range(k + 1)]
        probs = Sampler.target_probs(shaped[index[rows].reshape(-1)], params, SamplingColumns.of(params, dev))
        uniform = torch.empty(len(random), k, device=dev)
        exponential = torch.empty(len(random), shaped.shape[1], device=dev)
        if any(seqs[b].generator is None for b in random):
            uniform.uniform_()
            fill_exponential(exponential)
        for i, b in enumerate(random):
            g = seqs[b].generator
            if g is not None:   # as many draws as its own drafts, so that its stream is the same in any batch
                uniform[i, :counts[b]].uniform_(generator=g)
                fill_exponential(exponential[i], g)
        r_tokens, r_emitted = verify(probs.view(len(random), k + 1, -1), draft_t[rows], num_t[rows], None,
                                     uniform, exponential)
        tokens = tokens.index_copy(0, rows, r_tokens)
        emitted = emitted.index_copy(0, rows, r_emitted)
    flat_host = host_read(torch.cat([tokens.reshape(-1), emitted]))    # the step's one read back
    out = [flat_host[i * (k + 1):i * (k + 1) + m] for i, m in enumerate(flat_host[B * (k + 1):])]
    return out, first_rows
