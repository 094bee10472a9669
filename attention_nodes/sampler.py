"""Turn last-position logits into next tokens: greedy, temperature, top-k, top-p.

B = batch rows (one per running request), V = vocabulary size.
"""
from __future__ import annotations

import torch

from attention_nodes.sampling_params import SamplingParams
from comm.sync_audit import host_read

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


class Sampler:
    """Picks one token per row. Stateless: per-request randomness lives in the generators."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """Return one token id per row.

        logits: `[B, V]` any float dtype, on the generators' device; computed in float32.
        params: B sampling params; temperature 0 rows take argmax (first max on ties,
            as Hugging Face greedy generate does).
        generators: B generators, one per seeded request; None draws from torch's global RNG.
            Each row draws from its own generator only, so a seeded request's tokens do not
            depend on which other rows share the batch or their order.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"got {num_rows} logit rows, {len(params)} params and {len(generators)} generators; "
                "pass one of each per row")
        logits = logits.float()
        # Greedy for every row is cheap; random rows overwrite theirs below.
        tokens = host_read(logits.argmax(dim=-1))   # the one read back of a decode step (sync audit)
        rand_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not rand_rows:
            return tokens
        device = logits.device
        rows = torch.tensor(rand_rows, device=device)
        temp = torch.tensor([params[i].temperature for i in rand_rows], device=device)
        top_k = torch.tensor([params[i].top_k for i in rand_rows], dtype=torch.int64, device=device)
        top_p = torch.tensor([params[i].top_p for i in rand_rows], dtype=torch.float32, device=device)
        scaled = logits.index_select(0, rows) / temp.unsqueeze(1)
        probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
        # Only the draw loops: a multinomial call takes one generator.
        for j, i in enumerate(rand_rows):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
        return tokens
