"""Turn last-position logits into next tokens: greedy, temperature, min-p, top-k, top-p.

B = batch rows (one per running request), V = vocabulary size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attention_nodes.sampling_params import SamplingParams
from comm.sync_audit import cpu_numpy, host_read

# Cumulative sums that land within this of top_p count as reaching it, so that
# float32 rounding of e.g. 0.5 + 0.3 does not decide whether a third token is kept.
_TOP_P_EPS = 1e-6


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and nucleus with -inf (one sort for all rows).

    logits: `[B, V]` float32, already divided by temperature.
    top_k: `[B]` int64, 0 = off; values above V act as V.
    top_p: `[B]` float32 in (0, 1], 1 = off. Keeps the smallest set of highest-probability
        tokens (after top-k) whose probability sums to >= top_p; always at least one token.
    Returns a new `[B, V]` float32 tensor; `logits` is not modified.
    """
    num_rows, vocab = logits.shape
    assert top_k.shape == (num_rows,) and top_p.shape == (num_rows,), (top_k.shape, top_p.shape)
    # Step 1: sort each row once, highest first.
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).expand(num_rows, vocab)
    # Step 2: top-k by rank, so exactly k survive even when values tie.
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = rank >= k.unsqueeze(1)
    # Step 3: top-p on what top-k kept. A token stays while the mass strictly above it is < p.
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_p = (mass_before >= (top_p - _TOP_P_EPS).unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop |= drop_p
    drop[:, 0] = False
    # Step 4: undo the sort.
    drop_orig = torch.empty_like(drop).scatter_(1, sorted_idx, drop)
    return logits.masked_fill(drop_orig, float("-inf"))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax `[B]` int64 (the first maximum on ties; a NaN counts as the maximum), as
    x.argmax(dim=-1). A contiguous float32 CPU tensor goes through numpy's argmax: torch's CPU argmax over
    [64, 2048] took ~115-145 us on one thread of the 2-core dev VM, numpy's ~11 us (about as long as x.amax),
    and on a 64-sequence decode step the greedy pick was half of sampling's host time. That path runs only on the
    CPU, so the sync audit does not count it (comm/sync_audit.py cpu_numpy); on a GPU this is torch's argmax."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() \
            and not x.requires_grad:
        return torch.from_numpy(np.argmax(cpu_numpy(x), axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


def fill_exponential(q: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill q in place with Exp(1) draws from generator (None: torch's global RNG) and return it.

    Drawn as -log(U), U ~ Uniform[0, 1): on CPU several times faster than Tensor.exponential_ (bench/sampling.py
    times both). q is never 0 (U < 1), so probs / q is never 0 / 0; U = 0 gives q = inf, which only drops that
    token from this one draw (probability 2^-24 per entry in float32).
    """
    return q.uniform_(generator=generator).log_().neg_()


class Sampler:
    """Picks one token per row in one pass over the batch. Stateless: per-request randomness lives in the
    generators.

    Random rows use the exponential race: argmax(probs / q) with q ~ Exp(1) per (row, token) picks token t with
    probability probs[t] (the Gumbel-max trick in another form, as vLLM's sampler draws).
    """

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        columns: SamplingColumns | None = None,
    ) -> list[int]:
        """draw()'s token ids as Python ints: the batch's one host read."""
        return host_read(self.draw(logits, params, generators, columns))   # the one read back of a decode step

    def draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        columns: SamplingColumns | None = None,
    ) -> torch.Tensor:
        """Return `[B]` int64 token ids, on logits' device; nothing is read back to the host.

        logits: `[B, V]` any float dtype, on the generators' device; computed in float32.
        params: B sampling params; temperature 0 rows take argmax (first max on ties,
            as Hugging Face greedy generate does) and draw nothing.
        generators: B generators, one per seeded request; None draws from torch's global RNG.
            A seeded row's q comes from its own generator only (V draws per step), so a seeded request's
            tokens do not depend on which other rows share the batch or their order.
        columns: params' temperature, top_k, top_p and min_p as device tensors, as the engine keeps them across steps
            (InputBatch.sampling_columns); None builds them from params.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"got {num_rows} logit rows, {len(params)} params and {len(generators)} generators; "
                "pass one of each per row")
        logits = logits.float()
        greedy = argmax_rows(logits)
        if all(p.is_greedy for p in params):
            return greedy
        if columns is None:
            columns = SamplingColumns.of(params, logits.device)
        probs = self.target_probs(logits, params, columns)
        # Step 3: q ~ Exp(1). Unseeded rows share one batched draw; each seeded row overwrites its row from its
        # own generator (a loop over seeded rows only, with no host reads). Greedy rows' q is never used.
        q = torch.empty_like(probs)
        if any(g is None and not p.is_greedy for p, g in zip(params, generators)):
            fill_exponential(q)
        for i, (p, g) in enumerate(zip(params, generators)):
            if g is not None and not p.is_greedy:
                fill_exponential(q[i], g)
        # Step 4: the race, then greedy rows keep their argmax.
        return torch.where(columns.temperature == 0, greedy, argmax_rows(probs.div_(q)))

    @staticmethod
    def target_probs(logits: torch.Tensor, params: list[SamplingParams], columns: SamplingColumns) -> torch.Tensor:
        """`[B, V]` float32: the distribution each row draws from (temperature, min-p, top-k and top-p, then
        softmax). Greedy rows get temperature 1 (their probabilities are not used)."""
        # Step 1: temperature (1 on greedy rows, whose draw is discarded).
        scaled = logits / torch.where(columns.temperature == 0, 1.0, columns.temperature).unsqueeze(1)
        # Step 1b: min-p (vLLM's place for it: after temperature, before top-k and top-p): a token stays if its
        # probability is at least min_p times the row's highest (rows with min_p 0 keep every token).
        if any(not p.is_greedy and p.min_p > 0 for p in params):
            probs = scaled.softmax(dim=-1)
            drop = probs < columns.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            scaled = scaled.masked_fill(drop, float("-inf"))
        # Step 2: top-k and top-p over the whole batch when a random row asks for either (rows that ask for
        # neither have k = 0 and p = 1, which keep every token).
        if any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params):
            scaled = apply_top_k_top_p(scaled, columns.top_k, columns.top_p)
        return scaled.softmax(dim=-1)


@dataclass(frozen=True, slots=True)
class SamplingColumns:
    """A batch's sampling parameters as `[B]` device tensors: temperature float32 (0 = greedy), top_k int64
    (0 = off), top_p float32 (1 = off), min_p float32 (0 = off)."""
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device) -> SamplingColumns:
        """Built from the params' Python values (one small copy to the device; top_k capped at 2**24, which
        float32 holds exactly and which acts as "off" for any vocabulary, as InputBatch's table does)."""
        table = torch.tensor([(p.temperature, min(p.top_k, 2**24), p.top_p, p.min_p) for p in params],
                             dtype=torch.float32, device=device).view(-1, 4)
        return cls(table[:, 0], table[:, 1].long(), table[:, 2], table[:, 3])
