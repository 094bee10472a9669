"""Speculative decoding's pure pieces (issue 30): proposing draft tokens by prompt lookup, verifying a step's
drafts against the target model's probabilities so that the emitted tokens follow the target's distribution exactly
(Leviathan et al. 2023; Chen et al. 2023), and drafts that stay on the device (`DeviceDrafts`). The engine's side
is attention_nodes/speculation.py.

Verification, per request with d <= k drafts x_1..x_d, target probabilities p_1..p_{d+1} at the d + 1 positions
(p_i: the distribution of position i given the prompt and x_1..x_{i-1}) and draft probabilities q_1..q_d: x_i is
accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the first rejection; at a rejected position
i the emitted token is drawn from the residual norm(max(0, p_i - q_i)), and when all d are accepted a bonus token
is drawn from p_{d+1}. A prompt-lookup draft is deterministic: q_i is one-hot at x_i. Greedy requests pass
one-hot targets (at each argmax), which accepts exactly the drafts that greedy decoding would have produced and
emits the argmax at the first mismatch: the tokens without speculation.

Shapes: B requests, k draft slots, V vocabulary. The random draws come in from the caller (per-request seeded
generators fill their rows, as the sampler does), and nothing reads the device on the host.
"""
from __future__ import annotations

import numpy as np
import torch


PLACEHOLDER = -1     # a device draft's stand-in in the host lists (never a token id)


class DeviceDrafts(list):
    """Drafts a model proposed on the device (the draft model's, the MTP layers'), left there: the next step's
    batch takes them into its input ids on the device, and verification reads them back with the emitted tokens,
    in the step's one read. To the host (the scheduler, the batch's lists) they are `count` placeholders; a slice
    from 0 keeps the first drafts. values: `[n, k]` int64 on the device, this sequence's drafts in row `row`."""

    __slots__ = ("values", "row")

    def __init__(self, values: torch.Tensor, row: int, count: int):
        super().__init__([PLACEHOLDER] * count)
        self.values, self.row = values, row

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if start or step != 1:
                raise IndexError("device drafts slice from their first draft only")
            return DeviceDrafts(self.values, self.row, stop)
        return super().__getitem__(i)

    def read(self) -> list[int]:
        """The values, read back (for tests and for requests whose logits are shaped by the tokens before them)."""
        return self.values[self.row, :len(self)].tolist()


def place_drafts(target: torch.Tensor, spans: list[tuple[int, DeviceDrafts]], index) -> None:
    """Write device drafts into target (flat, on the device) in place: span (at, d) puts d's values at
    target[at : at + len(d)]. index(list) -> an int64 index tensor on target's device (the caller's staging)."""
    groups: dict[int, tuple[torch.Tensor, list[int], list[int], list[int]]] = {}
    for at, d in spans:
        values, dst, rows, cols = groups.setdefault(id(d.values), (d.values, [], [], []))
        dst.extend(range(at, at + len(d)))
        rows.extend([d.row] * len(d))
        cols.extend(range(len(d)))
    for values, dst, rows, cols in groups.values():
        target[index(dst)] = values[index(rows), index(cols)]


def ngram_propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Prompt lookup: the longest n in [min_n, max_n] whose last n tokens occurred earlier in `tokens` (prompt
    plus output so far), and up to k tokens that followed its latest earlier occurrence. Empty when none does.
    tokens: 1-D int array.

    One pass finds the earlier places of the last token; each one's match is extended backwards against the
    suffix, a vector step per extra token of n (O(length + places x max_n), not O(length x max_n))."""
    if k < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"ngram_propose: k={k}, min_n={min_n}, max_n={max_n}: need k >= 1 and 1 <= min_n <= max_n")
    total = len(tokens)
    if total < min_n + 1:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:total - 1] == tokens[total - 1])   # where an earlier occurrence could end
    if ends.size == 0:
        return tokens[:0]
    length = np.ones(ends.size, dtype=np.int64)     # how many of the suffix's last tokens match ending there
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(max_n, total - 1)):
        back = ends - j
        alive &= back >= 0
        alive[alive] = tokens[back[alive]] == tokens[total - 1 - j]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_n:
        return tokens[:0]
    start = int(ends[np.flatnonzero(length >= best)[-1]]) + 1
    return tokens[start:start + k]


def verify(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
           draft_probs: torch.Tensor | None, uniform: torch.Tensor, exponential: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify each request's drafts -> (tokens `[B, k + 1]` int64: the accepted drafts, then the residual or bonus
    token, then -1; num_emitted `[B]` int64, 1..num_drafts + 1).

    target_probs: `[B, k + 1, V]` float32 (rows beyond a request's num_drafts + 1 are not read).
    draft_tokens: `[B, k]` int64 (slots beyond num_drafts are ignored).
    num_drafts: `[B]` int64 in 0..k.
    draft_probs: `[B, k, V]`, or None for deterministic drafts (one-hot: prompt lookup).
    uniform: `[B, k]` in [0, 1), the acceptance draws; exponential: `[B, V]` Exp(1) draws for the emitted token
    (the exponential race: argmax(probs / E) is a draw from probs)."""
    B, k = draft_tokens.shape
    if k < 1:
        raise ValueError(f"verify: draft_tokens has {k} slots; pass at least one (num_drafts may be 0)")
    slots = torch.arange(k, device=draft_tokens.device)
    valid = slots < num_drafts.unsqueeze(1)
    safe = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens))
    p = target_probs[:, :k].gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    accepted = (uniform * q < p) & valid
    # the first slot not accepted (num_drafts when every draft is): where the emitted token is drawn
    first = torch.where(accepted, k, slots).amin(dim=1).clamp(max=num_drafts)
    at = first.view(B, 1, 1).expand(B, 1, target_probs.shape[-1])
    probs = target_probs.gather(1, at).squeeze(1)
    # where a draft was rejected the token comes from the residual max(0, p - q) (the race needs no normalising)
    last = first.clamp(max=k - 1)
    if draft_probs is None:
        q_rows = torch.zeros_like(probs).scatter_(1, safe.gather(1, last.unsqueeze(1)), 1.0)
    else:
        q_rows = draft_probs.gather(1, last.view(B, 1, 1).expand_as(at)).squeeze(1)
    rejected = (first < num_drafts).unsqueeze(1)
    probs = torch.where(rejected, (probs - q_rows).clamp(min=0), probs)
    emitted = (probs / exponential).argmax(dim=-1)
    tokens = torch.where(slots < first.unsqueeze(1), draft_tokens, torch.full_like(draft_tokens, -1))
    tokens = torch.cat([tokens, torch.full_like(tokens[:, :1], -1)], dim=1)
    tokens.scatter_(1, first.unsqueeze(1), emitted.unsqueeze(1))
    return tokens, first + 1


def verify_greedy(targets: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` for greedy requests, from each position's argmax alone (no probabilities): targets `[B, k + 1]`
    int64, the argmax at each position. The accepted drafts are the longest prefix equal to the argmax chain, and
    the argmax at the first mismatch (or at the bonus position) follows: as `verify` with one-hot targets."""
    B, k = draft_tokens.shape
    slots = torch.arange(k, device=draft_tokens.device)
    match = (draft_tokens == targets[:, :k]) & (slots < num_drafts.unsqueeze(1))
    first = torch.where(match, k, slots).amin(dim=1).clamp(max=num_drafts)
    keep = torch.arange(k + 1, device=targets.device) <= first.unsqueeze(1)
    return torch.where(keep, targets, torch.full_like(targets, -1)), first + 1
