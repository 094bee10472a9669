"""Front-side bookkeeping of one request's samples (SamplingParams.n, best_of): the engine reports each sample
under its own id, f"{request id}#{index}" (see Sequence.group_id); the front gathers them back per request and,
with best_of, returns the n whose tokens have the highest summed log-probability. `Gathering` is what
`LLM.generate` keeps of its requests as their rows arrive, stop strings (SamplingParams.stop) among it."""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from attention_nodes.sampling_params import SamplingParams
from attention_nodes.sequence import sample_ids

__all__ = ["Gathering", "RequestOutput", "Sample", "chosen", "sample_ids", "split_id", "stop_reason_ids"]


def split_id(row_id: str, grouped: set[str]) -> tuple[str, int]:
    """(request id, sample index) of an engine output row id; grouped: the ids of requests with samples."""
    rid, sep, index = row_id.rpartition("#")
    if sep and rid in grouped:
        return rid, int(index)
    return row_id, 0


def stop_reason_ids(params: SamplingParams, eos_token_ids, tokenizer) -> frozenset:
    """The token ids that are a sample's stop_reason when one ends it (vLLM's): its stop_token_ids and the
    checkpoint's other EOS ids (vLLM adds them to stop_token_ids), never the tokenizer's own EOS; under ignore_eos,
    EOS ids are stop tokens only if given."""
    if params.ignore_eos:
        return frozenset(params.stop_token_ids)
    return (frozenset(params.stop_token_ids) | set(eos_token_ids)) - {getattr(tokenizer, "eos_token_id", None)}


class Abandoned:
    """The requests of a generate() that raised -> how many of their samples are still open in the engine: their
    rows are dropped, each request until its last sample's final row. Safe to share between the threads reading the
    outbox (generate(), and stats() from another)."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, rid: str, open_samples: int) -> None:
        with self._lock:
            self._open[rid] = open_samples

    def __contains__(self, rid: str) -> bool:
        return rid in self._open

    def __len__(self) -> int:
        return len(self._open)

    def drops(self, rid: str, final: bool) -> bool:
        """Whether a row of rid (final: it ends its sample) is dropped; a final one is counted."""
        with self._lock:
            if rid not in self._open:
                return False
            if final:
                self._open[rid] -= 1
                if not self._open[rid]:
                    del self._open[rid]
            return True


def split_rows(msg: tuple, mine: dict | set, grouped: set[str], dropped: Abandoned) -> tuple[list, tuple | None]:
    """An outbox message generate() read -> (its rows of the requests in mine, what is left for another reader:
    someone else's rows or answer, or None). Rows of dropped requests (a generate that raised) are dropped."""
    if msg[0] != "out":
        return [], msg
    own, others = [], []
    for row in msg[1]:
        if split_id(row[0], grouped)[0] in mine:
            own.append(row)
        elif not dropped.drops(split_id(row[0], dropped)[0], row[2] is not None):
            others.append(row)
    return own, ("out", others) if others else None


@dataclass(slots=True)
class Sample:
    """One sample of a request. logprobs: one {token id: log-probability} per token when asked for (or needed
    by best_of); cumulative_logprob: their sum over the sampled tokens (None without them)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None    # vLLM's: the stop string, or the stop_token_ids id, that ended it
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """vLLM's CompletionOutput.finished()."""
        return self.finish_reason is not None

    def add(self, tokens: list[int], logprobs: list[dict[int, float]] | None, finish: str | None) -> None:
        self.token_ids += tokens
        if logprobs:
            self.logprobs = (self.logprobs or []) + logprobs
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + sum(e[t] for t, e in zip(tokens, logprobs))
        if finish is not None:
            self.finish_reason = finish


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result. token_ids: the generated ids only; text: decoded (None without a tokenizer);
    finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or the context limit) or "abort".
    prompt_logprobs: with SamplingParams.prompt_logprobs set, one entry per prompt token: None for the first,
    then {token id: log-probability} holding the prompt token and the top alternatives asked for.
    logprobs: with SamplingParams.logprobs set, one such dict per generated token.
    prompt_logprob_ranks: beside prompt_logprobs, each prompt token's rank in the vocabulary (vLLM's Logprob.rank:
    its place among the top k when it is one of them, else how many tokens are at least as likely); None for the
    first.
    samples: the SamplingParams.n samples (with best_of: the best n, best first); token_ids, text, finish_reason
    and logprobs above are the first one's.
    num_cached_tokens: the prompt tokens the engine found in its prefix cache when it first admitted the request
    and did not compute (vLLM's; 0 with enable_prefix_caching off or with prompt_logprobs, which score every
    position; None for a request aborted before it was admitted).
    stop_reason: vLLM's, the first sample's: the stop string (SamplingParams.stop) or stop_token_ids id that
    ended it, else None."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    logprobs: list[dict[int, float]] | None = None
    samples: list[Sample] = field(default_factory=list)
    prompt_logprob_ranks: list[int | None] | None = None
    num_cached_tokens: int | None = None
    stop_reason: str | int | None = None
    prompt: str | None = None     # the prompt's text as given (vLLM's): None for token ids alone

    @property
    def outputs(self) -> list[Sample]:
        """vLLM's name for `samples` (its CompletionOutputs: index, text, token_ids, cumulative_logprob,
        logprobs, finish_reason, stop_reason)."""
        return self.samples

    @property
    def finished(self) -> bool:
        """vLLM's: whether the whole request has finished; what `LLM.generate` returns always has."""
        return all(s.finished() for s in self.samples)


def vllm_rank(entry: dict[int, float], token: int, count: int, k: int) -> int:
    """vLLM's rank of a scored token shown with the top k: its place among them when it is one of them, else
    count (how many tokens are at least as likely). entry: the engine's, its top alternatives first, most likely
    first (at least k of them)."""
    for i, t in enumerate(entry):
        if i == k:
            break
        if t == token:
            return i + 1
    return count


def chosen(samples: list[Sample], params: SamplingParams) -> list[Sample]:
    """The samples to return: all n of them, or with best_of the n with the highest cumulative logprob (ties: the
    lower index), best first. Logprobs drawn only for the ranking are dropped."""
    if params.num_samples == params.n:
        return sorted(samples, key=lambda s: s.index)
    best = sorted(samples, key=lambda s: (-(s.cumulative_logprob or 0.0), s.index))[:params.n]
    if params.logprobs is None:
        for s in best:
            s.logprobs = None
    return best


class Gathering:
    """`LLM.generate`'s requests as their outbox rows arrive: each sample's tokens and logprobs, the prompt's
    scores and cached count, and with stop strings each sample's text as it grows (launch/frontend/text.py's
    TextStream, as the server's). A sample a stop string ended is over for the caller at once: `take` names it,
    the caller aborts it in the engine, and its later rows, up to its final one, are dropped (`stopping`)."""

    def __init__(self, rids: list[str], params: list[SamplingParams], tokenizer, eos_token_ids=()):
        self.rids, self.params = rids, dict(zip(rids, params))
        self._stop_ids = {rid: stop_reason_ids(p, eos_token_ids, tokenizer) for rid, p in zip(rids, params)}
        self.samples: dict[str, dict[int, Sample]] = {rid: {} for rid in rids}
        self.scores = {rid: [] if p.prompt_logprobs is not None else None for rid, p in self.params.items()}
        self.cached: dict[str, int | None] = dict.fromkeys(rids)
        self.grouped = {rid for rid, p in self.params.items() if p.num_samples > 1}
        self.num_open = sum(p.num_samples for p in params)
        self.stopping: set[str] = set()     # rows a stop string ended whose final row has not come
        self._tokenizer = tokenizer
        self._texts: dict[str, tuple] = {}    # row id -> (its TextStream, the text pieces so far)

    def take(self, row: list) -> str | None:
        """One of this call's rows -> the row id of a sample a stop string just ended (to abort), or None."""
        row_id, toks, reason, new_prompt_logprobs, new_logprobs, num_cached = row
        if row_id in self.stopping:
            if reason is not None:
                self.stopping.discard(row_id)
            return None
        rid, index = split_id(row_id, self.grouped)
        p = self.params[rid]
        if self.cached[rid] is None:       # the first admission's count (every sample's row carries it)
            self.cached[rid] = num_cached
        sample = self.samples[rid].setdefault(index, Sample(index))
        sample.add(toks, new_logprobs, reason)
        if new_prompt_logprobs:     # (entry, rank) pairs, None for the first prompt token
            self.scores[rid].extend(new_prompt_logprobs)
        if reason == "stop" and toks and toks[-1] in self._stop_ids[rid]:
            sample.stop_reason = toks[-1]
        if p.stop:
            if row_id not in self._texts:
                from .frontend.text import TextStream
                self._texts[row_id] = (TextStream(self._tokenizer, p.stop, min_tokens=p.min_tokens,
                                                  include_stop=p.include_stop_str_in_output), [])
            stream, pieces = self._texts[row_id]
            pieces.append(stream.add(toks, final=reason is not None,
                                     hide_last=bool(toks) and reason == "stop" and not stream.include_stop))
            if stream.stopped:
                sample.finish_reason, sample.stop_reason = "stop", stream.stop_reason
                if reason is None:         # the engine would go on: the caller ends it
                    self.num_open -= 1
                    self.stopping.add(row_id)
                    return row_id
        self.num_open -= reason is not None
        return None

    def unfinished(self) -> dict[str, int]:
        """Per request, how many of its samples the engine has not ended yet: those a stop string ended whose
        final row is still to come, and (when the call raised) those still running."""
        left = Counter({rid: p.num_samples - sum(s.finish_reason is not None for s in self.samples[rid].values())
                        for rid, p in self.params.items()})
        left.update(split_id(row_id, self.grouped)[0] for row_id in self.stopping)
        return {rid: n for rid, n in left.items() if n}

    def outputs(self, prompts: list[list[int]], decode, texts: list[str | None] | None = None
                ) -> list[RequestOutput]:
        """One output per request, in order. decode: token ids -> text (without stop strings); texts: each
        prompt's text as the caller gave it, or None."""
        outs = []
        for rid, ids, given in zip(self.rids, prompts, texts or [None] * len(prompts)):
            p = self.params[rid]
            best = chosen(list(self.samples[rid].values()), p)
            for s in best:   # the EOS or stop token id that ended a sample is not in its text (vLLM's)
                row_id = sample_ids(rid, p.num_samples)[s.index]
                s.text = "".join(self._texts[row_id][1]) if row_id in self._texts else \
                    decode(s.token_ids[:-1] if s.finish_reason == "stop" and not p.include_stop_str_in_output
                           else s.token_ids)
            first, scored = best[0], self.scores[rid]
            outs.append(RequestOutput(rid, ids, first.token_ids, first.text, first.finish_reason,
                                      None if scored is None else [e and e[0] for e in scored], first.logprobs, best,
                                      None if scored is None else [e and vllm_rank(e[0], t, e[1], p.prompt_logprobs)
                                                                   for t, e in zip(ids, scored)],
                                      self.cached[rid], first.stop_reason, given))
        return outs
