"""Beam search over the engine, as vLLM runs it (its `LLM.beam_search` and the server's `use_beam_search`): each
step asks the engine for one token of every live beam, with the 2 * beam_width most likely next tokens' log-
probabilities, extends each beam by each of those candidates, and keeps the beam_width best by summed log-
probability; a candidate that is an EOS token ends its beam (kept as completed) unless ignore_eos. After
max_tokens steps, or once no beam is live, the completed and live beams are ranked by score (summed log-
probability over (tokens, prompt included, less a final EOS) ** length_penalty) and the best beam_width are the
answer. Each step's requests share the prompt's and the beams' earlier blocks through the prefix cache.

`search` is the algorithm alone, a generator: it yields each step's beams (token id lists) and takes back each
beam's candidates ({token id: log-probability}); `Searches` runs several prompts' together, which
`LLM.beam_search` drives with `generate` and the HTTP front with its engine client (launch/frontend/beam.py)."""
from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field

from attention_nodes.sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSequence", "Searches", "search"]


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's: beam_width beams (1 to MAX_LOGPROBS // 2: each step asks for 2 * beam_width candidates), at most
    max_tokens generated tokens each; temperature scales the step's draw (whose token joins the candidates; 0:
    greedy, the candidates are the most likely tokens either way); length_penalty the score's exponent;
    include_stop_str_in_output keeps a final EOS in the tokens and text; skip_special_tokens leaves special
    tokens out of the text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if type(self.beam_width) is not int or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width!r} is invalid: pass an integer in "
                             f"[1, {MAX_LOGPROBS // 2}] (each step asks for 2 * beam_width candidates)")
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens={self.max_tokens!r} is invalid: pass an integer >= 1")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or isinstance(lp, float) and not math.isfinite(lp):
            raise ValueError(f"BeamSearchParams.length_penalty={lp!r} is invalid: pass a finite number")
        self.length_penalty = float(max(min(lp, 1e308), -1e308))     # an int's power of the length could run forever
        self.step_params()      # temperature's check

    def step_params(self) -> SamplingParams:
        """The engine's parameters for one beam's step."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True)


@dataclass(slots=True)
class BeamSequence:
    """One beam: tokens (the prompt's, then the generated ones), the log-probability entries of the generated
    ones, their sum, and once answered its text (generated tokens only), finish_reason ("stop": an EOS ended
    it; "length") and stop_reason (that EOS id, as vLLM's beam search says)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None
    text: str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(slots=True)
class BeamSearchOutput:
    """vLLM's: the best beam_width beams of one prompt, best first."""

    sequences: list[BeamSequence]


def score(beam: BeamSequence, eos: frozenset[int], length_penalty: float) -> float:
    """vLLM's (after transformers'): the summed log-probability over the length ** length_penalty, the length
    counting the prompt and not a final EOS."""
    n = len(beam.tokens) - (bool(beam.tokens) and beam.tokens[-1] in eos)
    try:
        return beam.cum_logprob / max(n, 1) ** length_penalty
    except OverflowError:        # the length's power is past float's range: its quotient is 0
        return -0.0
    except ZeroDivisionError:    # the power rounds to 0 (a huge negative penalty): -inf, or 0 for a sure beam
        return -math.inf if beam.cum_logprob < 0 else 0.0


def search(prompt: list[int], params: BeamSearchParams, eos: frozenset[int]
           ) -> Generator[list[list[int]], list[dict[int, float]], list[BeamSequence]]:
    """Beam search of one prompt. Yields the live beams' tokens; send back, per beam, its next token's candidates
    ({token id: log-probability}). Returns the best beam_width beams, best first (their text is not set)."""
    k, n = params.beam_width, len(prompt)
    live = [BeamSequence(list(prompt), num_prompt_tokens=n)]
    done: list[BeamSequence] = []
    for _ in range(params.max_tokens):
        answers = yield [b.tokens for b in live]
        grown = []
        for beam, cands in zip(live, answers, strict=True):
            for tok, lp in cands.items():
                nxt = BeamSequence(beam.tokens + [tok], beam.cum_logprob + lp, beam.logprobs + [cands],
                                   num_prompt_tokens=n)
                if tok in eos and not params.ignore_eos:
                    nxt.finish_reason, nxt.stop_reason = "stop", tok
                    done.append(nxt)
                else:
                    grown.append(nxt)
        # the same length for all: by summed log-probability (stable: a tie keeps the earlier beam's candidate)
        live = sorted(grown, key=lambda b: -b.cum_logprob)[:k]
        if not live:
            break
    for beam in live:
        beam.finish_reason = "length"
    best = sorted(done + live, key=lambda b: -score(b, eos, params.length_penalty))[:k]
    if not params.include_stop_str_in_output:
        for beam in best:
            if beam.finish_reason == "stop":
                beam.tokens = beam.tokens[:-1]
                beam.logprobs = beam.logprobs[:-1]
    return best


class Searches:
    """Several prompts' searches driven together: `beams()` lists every live beam as (prompt index, token ids),
    `answer` takes their candidates in that order, `done` once every search has ended, `found` their results."""

    def __init__(self, prompts: list[list[int]], params: list[BeamSearchParams], eos: frozenset[int]):
        self._runs = [search(p, q, eos) for p, q in zip(prompts, params)]
        self._asked: list[list[list[int]] | None] = [next(r) for r in self._runs]
        self.found: list[list[BeamSequence] | None] = [None] * len(prompts)

    @property
    def done(self) -> bool:
        return all(a is None for a in self._asked)

    def beams(self) -> list[tuple[int, list[int]]]:
        return [(j, b) for j, a in enumerate(self._asked) if a is not None for b in a]

    def answer(self, beams: list[tuple[int, list[int]]], candidates: list[dict[int, float]]) -> None:
        per: dict[int, list[dict[int, float]]] = {}
        for (j, _), c in zip(beams, candidates, strict=True):
            per.setdefault(j, []).append(c)
        for j, cands in per.items():
            try:
                self._asked[j] = self._runs[j].send(cands)
            except StopIteration as done:
                self._asked[j], self.found[j] = None, done.value


def beam_search(llm, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """`LLM.beam_search`: every prompt's search at once, each step one `generate` call over all their live beams.
    prompts: as generate's (a prompt dict's cache_salt goes with every step request of its prompt)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params={params!r} is not a BeamSearchParams")
    if llm.runtime is not None:
        raise ValueError("beam_search runs from a plain process (LLM's own ranks) or the server's "
                         "use_beam_search, not under torchrun, where every rank would have to follow its steps")
    inputs = llm.admission.prompt_inputs(prompts)
    ids, salts = [i.ids for i in inputs], [i.cache_salt for i in inputs]
    for i in ids:
        llm.admission.check_fits(i, SamplingParams(max_tokens=params.max_tokens))
    searches, step = Searches(ids, [params] * len(ids), frozenset(llm.spec.eos_token_ids)), params.step_params()
    while not searches.done:
        beams = searches.beams()
        outs = llm.generate([b if salts[j] is None else {"prompt_token_ids": b, "cache_salt": salts[j]}
                             for j, b in beams], step)
        if aborted := [o.request_id for o in outs if o.finish_reason == "abort"]:
            raise RuntimeError(f"the engine aborted beam search step request {aborted[0]!r}")
        searches.answer(beams, [o.logprobs[0] for o in outs])
    for best in searches.found:
        for beam in best:
            beam.text = None if llm.tokenizer is None else llm.tokenizer.decode(
                beam.output_ids, skip_special_tokens=params.skip_special_tokens)
    return [BeamSearchOutput(best) for best in searches.found]
