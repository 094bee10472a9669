"""Logprobs in OpenAI's two answer shapes, from the engine's per-token {token id: logprob} dicts (the token
plus the k most likely at its position; log-softmax of the raw logits, as vLLM returns by default).

  completions (legacy):  {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} |
                          None], "text_offset": [int]}; top_logprobs holds the token and the top k (k + 1
                          entries at most), as vLLM and OpenAI's legacy API do, the token first, then by rank.
                          None: the first prompt token.
  chat:                  {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                          "bytes"}]}]}; top_logprobs holds the k most likely tokens, most likely first.
  prompt_logprobs (vLLM's, non-streamed; per completion choice, beside a chat's choices):
                         [None, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]: per prompt token after
                          the first, the token (its rank in the vocabulary) and the k most likely (ranks 1..k).

A token's string is its own decode (special tokens kept), as vLLM gives it; "bytes" are that string's UTF-8
bytes, so a token holding part of a character reads U+FFFD (vLLM's too; OpenAI sends the raw bytes)."""
from __future__ import annotations

from dataclasses import dataclass

from ..samples import vllm_rank

LOGPROB_FLOOR = -9999.0   # sent for -inf, which JSON cannot carry (vLLM's and OpenAI's value)


@dataclass(slots=True)
class Position:
    """One token of a choice as the answer reports it."""

    token_id: int
    scores: dict[int, float] | None   # {token id: logprob}: the token and the top k; None: no context to score
    offset: int                       # where the token's text starts in the choice's text (completions)


class TokenNames:
    """Token id -> its own decode, cached for one request ("token_id:N" without a tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._cache.get(token_id)
        if name is None:
            name = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = name
        return name


def _floor(logprob: float) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


def completion_logprobs(names: TokenNames, positions: list[Position]) -> dict:
    """The legacy completions shape over positions (token first in each top_logprobs, then by rank)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in positions:
        out["tokens"].append(names(p.token_id))
        out["text_offset"].append(p.offset)
        if p.scores is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_floor(p.scores[p.token_id]))
        top: dict[str, float] = {}
        for t, lp in sorted(p.scores.items(), key=lambda kv: (kv[0] != p.token_id, -kv[1])):
            top.setdefault(names(t), _floor(lp))   # two ids with one string (e.g. U+FFFD): the first keeps it
        out["top_logprobs"].append(top)
    return out


def top_entries(entry: dict[int, float], token: int, k: int) -> dict[int, float]:
    """An engine entry (its top alternatives most likely first, then the token unless among them) cut to the
    token and the top k."""
    return {t: lp for i, (t, lp) in enumerate(entry.items()) if i < k or t == token}


def prompt_logprobs(names: TokenNames, prompt: list[int], scores: list, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs over a prompt from the engine's (entry, count) per token (None for the first; and
    for any the engine did not score, if the request ended before its prompt was done)."""
    out = []
    for i, token in enumerate(prompt):
        if i >= len(scores) or scores[i] is None:
            out.append(None)
            continue
        entry, count = scores[i]
        rank = vllm_rank(entry, token, count, k)
        shown = {str(token): {"logprob": _floor(entry[token]), "rank": rank, "decoded_token": names(token)}}
        for j, (t, lp) in enumerate(list(entry.items())[:k]):
            shown.setdefault(str(t), {"logprob": _floor(lp), "rank": j + 1, "decoded_token": names(t)})
        out.append(shown)
    return out


def _entry(name: str, logprob: float) -> dict:
    return {"token": name, "logprob": _floor(logprob), "bytes": list(name.encode("utf-8", errors="replace"))}


def chat_logprobs(names: TokenNames, positions: list[Position], top: int) -> dict:
    """The chat shape over positions (generated tokens, so every one is scored); top: k of top_logprobs."""
    content = []
    for p in positions:
        entry = _entry(names(p.token_id), p.scores[p.token_id])
        ranked = sorted(p.scores.items(), key=lambda kv: -kv[1])[:top]
        entry["top_logprobs"] = [_entry(names(t), lp) for t, lp in ranked]
        content.append(entry)
    return {"content": content}
