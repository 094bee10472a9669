"""What changes a request's logits before temperature, top-k and top-p: min_tokens, logit_bias and the
repetition, frequency and presence penalties (SamplingParams documents each; the order is vLLM's).

R = rows to sample, V = vocabulary size.
"""
from __future__ import annotations

import torch

from .sequence import Sequence


def shape_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]) -> torch.Tensor:
    """logits: `[R, V]` float32, row i sampling seqs[i]'s next token. Returns the logits to sample from (the same
    tensor when no request asks for anything; otherwise a copy, so the caller's raw logits stay raw)."""
    rows = [i for i, s in enumerate(seqs) if s.params.shapes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        seq, p, row = seqs[i], seqs[i].params, logits[i]
        if seq.num_output_tokens < p.min_tokens:
            stops = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)) if t < vocab]
            row[stops] = float("-inf")
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            row[ids] += torch.tensor([p.logit_bias[t] for t in ids], device=row.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            out = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=row.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[dict[int, float]]:
    """Per row: {token id: log-probability} holding the chosen token and the row's k most likely ones.
    logits: `[R, V]` raw logits; one host copy for all rows."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    k = max(ks)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    out = []
    for i, (tok, k_row) in enumerate(zip(tokens, ks)):
        entry = dict(zip(top_ids[i][:k_row], top_lp[i][:k_row]))
        entry[tok] = chosen[i]
        out.append(entry)
    return out
