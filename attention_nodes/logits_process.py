"""What changes a request's logits before temperature, top-k and top-p: allowed_token_ids, bad words, min_tokens,
logit_bias and the repetition, frequency and presence penalties (SamplingParams documents each; the order is
vLLM's).

R = rows to sample, V = vocabulary size.
"""
from __future__ import annotations

from itertools import chain

import torch

from .sequence import Sequence


def shape_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]) -> torch.Tensor:
    """logits: `[R, V]` float32, row i sampling seqs[i]'s next token. Returns the logits to sample from (the same
    tensor when no request asks for anything; otherwise a contiguous copy, so the caller's raw logits stay raw).

    Each step runs once for all rows, on the flattened `[R * V]` copy at ids row * V + token; rows that do not ask
    for it are untouched (a step's index lists hold only the rows that do, and a zero penalty subtracts 0).
    """
    if not any(s.params.shapes_logits for s in seqs):
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    vocab = logits.shape[1]
    flat = logits.view(-1)
    # Step 0a: allowed_token_ids: every other token is -inf.
    allowed = [(i, allowed_ids(s, vocab, logits.device)) for i, s in enumerate(seqs) if s.params.allowed_token_ids]
    if allowed:
        rows = torch.tensor([i for i, _ in allowed], dtype=torch.int64, device=logits.device)
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=logits.device)
        for j, (_, ids) in enumerate(allowed):
            keep[j].index_fill_(0, ids, True)
        logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    # Step 1 (the -inf steps commute, so before 0b here): min_tokens: EOS and stop tokens are -inf until enough
    # tokens are out.
    stops = {i: [t for t in (*s.params.stop_token_ids, *(() if s.params.ignore_eos else eos_token_ids)) if t < vocab]
             for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens}
    if stops:
        flat.index_fill_(0, _flat_ids(stops, vocab, logits.device), float("-inf"))
    # Step 0b: bad words: a word's last token is -inf where the output ends with the rest of it. One-token words
    # always (admission keeps something allowed past them and the stops); longer ones not in a row of
    # allowed_token_ids whose every token left they would ban (the allowed set wins: such a row would sample a
    # token outside it, as vLLM's does). Decided on the device: no host read.
    for longer in (False, True):
        banned = {i: hits for i, s in enumerate(seqs) if s.params.bad_words_token_ids
                  and (hits := _bad_word_ends([w for w in s.params.bad_words_token_ids if (len(w) > 1) == longer],
                                              s.token_ids, s.num_output_tokens, vocab))}
        if not banned:
            continue
        narrow = [i for i in banned if longer and seqs[i].params.allowed_token_ids]
        if narrow:
            rows = torch.tensor(narrow, dtype=torch.int64, device=logits.device)
            before = logits[rows]
        flat.index_fill_(0, _flat_ids(banned, vocab, logits.device), float("-inf"))
        if narrow:
            after = logits[rows]
            logits[rows] = torch.where(torch.isneginf(after).all(dim=1, keepdim=True), before, after)
    # Step 2: logit_bias, added (each request's keys are distinct, so no id is hit twice).
    biased = {i: [t for t in s.params.logit_bias if t < vocab] for i, s in enumerate(seqs) if s.params.logit_bias}
    if biased:
        bias = [seqs[i].params.logit_bias[t] for i, ids in biased.items() for t in ids]
        flat.index_put_((_flat_ids(biased, vocab, logits.device),),
                        torch.tensor(bias, dtype=logits.dtype, device=logits.device), accumulate=True)
    # Step 3: repetition penalty on every token of prompt and output. A token seen twice is gathered twice and
    # written twice with the same value, so no dedup is needed.
    repeated = {i: s.token_ids for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0}
    if repeated:
        ids = _flat_ids(repeated, vocab, logits.device)
        penalty = _column(seqs, "repetition_penalty", logits)[ids // vocab]
        vals = flat[ids]
        flat[ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    # Step 4: frequency and presence penalties: a token generated n times loses frequency * n + presence. n comes
    # from the sorted flat ids (the width of each id's run), so the cost follows the output length, not R * V,
    # and nothing is read back to the host; a token generated twice is written twice with the same value.
    counted = {i: s.output_token_ids for i, s in enumerate(seqs)
               if s.params.frequency_penalty or s.params.presence_penalty}
    if counted:
        ids = _flat_ids(counted, vocab, logits.device)
        sorted_ids = ids.sort().values
        times = (torch.searchsorted(sorted_ids, ids, right=True) - torch.searchsorted(sorted_ids, ids)).to(logits.dtype)
        rows = ids // vocab
        frequency = _column(seqs, "frequency_penalty", logits)[rows]
        presence = _column(seqs, "presence_penalty", logits)[rows]
        flat[ids] = flat[ids] - (frequency * times + presence)
    return logits


def allowed_ids(seq, vocab: int, device: torch.device) -> torch.Tensor:
    """seq's allowed token ids within the vocabulary on the device, kept on the sequence once built (a
    speculative view of one, `Ahead`, carries its sequence's)."""
    ids = seq.allowed_ids
    if ids is None:
        ids = seq.allowed_ids = torch.tensor([t for t in seq.params.allowed_token_ids if t < vocab],
                                             dtype=torch.int64, device=device)
    return ids


def _bad_word_ends(words: list[list[int]], token_ids: list[int], num_output: int, vocab: int) -> list[int]:
    """The last tokens of the words whose other tokens end the output (vLLM's rule: the prompt does not count)."""
    end = len(token_ids)
    return [w[-1] for w in words if w[-1] < vocab and len(w) - 1 <= num_output
            and token_ids[end - len(w) + 1:end] == w[:-1]]


def _column(seqs: list[Sequence], name: str, like: torch.Tensor) -> torch.Tensor:
    """`[R]` of each row's SamplingParams.<name>, in like's dtype and device."""
    return torch.tensor([getattr(s.params, name) for s in seqs], dtype=like.dtype, device=like.device)


def _flat_ids(tokens: dict[int, list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """`[N]` int64 ids into flattened `[R * V]` logits: row * V + token for every token of every row (in order).
    tokens: row -> token ids, each < V."""
    lengths = torch.tensor([len(t) for t in tokens.values()], dtype=torch.int64)
    flat_tokens = torch.tensor(list(chain.from_iterable(tokens.values())), dtype=torch.int64)
    assert flat_tokens.numel() == 0 or int(flat_tokens.max()) < vocab, f"a token id is outside [0, {vocab})"
    rows = torch.tensor(list(tokens), dtype=torch.int64).repeat_interleave(lengths)
    return (rows * vocab + flat_tokens).to(device)


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int],
                   with_rank: bool = False) -> list[dict[int, float]] | list[tuple[dict[int, float], int]]:
    """Per row: {token id: log-probability} holding the chosen token and the row's k most likely ones (most likely
    first, the chosen token last unless it is one of them). logits: `[R, V]` raw logits.
    with_rank: each entry comes as (entry, count), count being how many tokens are at least as likely as the chosen
    one (>= 1; vLLM's rank of it, unless the caller shows it among its top k: `launch.samples.vllm_rank`)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])
    k = max(ks)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    chosen, ranks = chosen_t[:, 0].tolist(), (logp >= chosen_t).sum(-1).tolist() if with_rank else None
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    out = []
    for i, (tok, k_row) in enumerate(zip(tokens, ks)):
        entry = dict(zip(top_ids[i][:k_row], top_lp[i][:k_row]))
        entry[tok] = chosen[i]
        out.append(entry if ranks is None else (entry, ranks[i]))
    return out
