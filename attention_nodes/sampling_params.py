"""Per-request sampling parameters, checked once at construction."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .structured import check_spec

MAX_LOGPROBS = 20  # the most top alternatives a request may ask for per position (vLLM's default cap)
MAX_SAMPLES = 64   # the most samples (n, best_of) one request may draw


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 or -1 (vLLM's) and top_p == 1 disable those filters. min_p (vLLM's, in
    [0, 1], 0 = off) drops the tokens whose probability, after temperature, is below min_p times the most likely
    one's.
    seed makes sampling reproducible per request, whatever else is in the batch.
    stop_token_ids end generation like EOS does (the stop token is kept in token_ids; the fronts leave its text
        out, as vLLM does).
    ignore_eos keeps generating past EOS until max_tokens.
    prompt_logprobs: None (off) or k >= 0: return each prompt token's log-probability given the tokens before
        it, plus the k most likely tokens at that position (vLLM's meaning). The first prompt token has none.
    logprobs: None (off) or k >= 0: each generated token's log-probability plus the k most likely tokens at its
        position. Log-probabilities are the model's own (log-softmax of the logits before penalties, bias and
        temperature), as vLLM returns by default.
    max_tokens may be 0 only with prompt_logprobs: the prompt is scored and nothing is generated ("length").
    min_tokens: EOS and stop_token_ids cannot end generation before this many tokens (their logits are -inf).
    logit_bias: {token id: bias in [-100, 100]} added to the logits (OpenAI's meaning).
    allowed_token_ids (vLLM's): None, or the only token ids that may be sampled (every other logit is -inf).
    bad_words_token_ids: token id sequences that may not be generated: a sequence's last token is -inf wherever
        the output so far ends with the rest of it (a one-token sequence always). vLLM's bad_words, tokenized (the
        HTTP front turns words into these as vLLM does); as vLLM's, only generated tokens count, not the prompt.
    repetition_penalty (> 0, 1 = off): a token already in the prompt or the output has a positive logit divided
        by it and a negative one multiplied (HF's and vLLM's meaning).
    frequency_penalty, presence_penalty (in [-2, 2]): subtracted from a token's logit per time it was generated
        and once if it was (OpenAI's meaning; generated tokens only).
    n: how many samples (choices) to return. best_of (>= n, None = n): how many to draw; the n with the highest
        cumulative log-probability of their tokens are returned. The samples are forked from the request once its
        prompt is computed: they share its KV blocks and copy only the last, partly filled one before writing
        to it. With a seed, sample i draws from its own generator seeded with seed + i.
    structured_outputs (vLLM's): None, or {"json": schema} (a dict or its JSON text), {"json_object": True},
        {"regex": pattern}, {"choice": [strings]} or {"grammar": EBNF}: the output follows it
        (attention_nodes/structured.py); with it, EOS may not be ignored (it ends the complete output), and
        min_tokens, allowed_token_ids and bad words are refused (they could mask every token the grammar allows).
    reasoning_end_token_id: None, or a token id (a thinking model's "</think>") that the output must reach before
        its structured_outputs bind: the tokens up to it are free (the model's reasoning), the grammar constrains
        the ones after it (vLLM's structured outputs under a reasoning parser). Needs structured_outputs.
    cache_salt (vLLM's, a request field there): None, or a non-empty string mixed into the prefix cache's keys, so
        the request shares cached blocks only with requests of the same salt (tenants cannot probe each other's
        prompts by timing).
    stop (vLLM's): strings that end the output where they appear; its text ends before the first one (with
        include_stop_str_in_output, after it), finish_reason "stop". The front that reads the text applies them
        (`LLM.generate`: launch/samples.py; the server takes its own field); the ranks never read them.
    priority (vLLM's, a request field there): under the engine's scheduling_policy "priority", a lower value is
        admitted first and preempted last (ties: the earlier arrival); under "fcfs" it must stay 0.
    stream_interval (vLLM's): None, or the fewest new tokens each streamed chunk of this request carries (first
        and last chunks aside); it raises the server's --stream-interval, never lowers it. Only a streaming front
        reads it (launch/frontend/engine_client.py).
    Order, as vLLM's sampler: the structured outputs' mask (it commutes with the rest: a masked token stays -inf),
    allowed_token_ids, bad words, min_tokens, logit_bias,
    repetition, frequency and presence penalties, temperature, min_p, top-k, top-p.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = 1
    best_of: int | None = None
    structured_outputs: dict | None = None
    reasoning_end_token_id: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, value, want: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r} is invalid: {want}")

        def number(name: str, lo: float, hi: float, want: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= float(v) <= hi:
                raise bad(name, v, want)
            return float(v)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0 \
                or self.max_tokens == 0 and self.prompt_logprobs is None:
            raise bad("max_tokens", self.max_tokens, "pass an integer >= 1 (0 only with prompt_logprobs set)")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not (0.0 <= float(self.temperature) < float("inf")):
            raise bad("temperature", self.temperature, "pass a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not (0.0 < float(self.top_p) <= 1.0):
            raise bad("top_p", self.top_p, "pass a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "pass an integer >= 0, or 0 or -1 (vLLM's) to disable it")
        self.top_k = max(self.top_k, 0)
        self.min_p = number("min_p", 0, 1, "pass a number in [0, 1] (0 = off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", self.seed, "pass an integer or None")
        if self.stop_token_ids is None:      # vLLM's default
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_id(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "pass a list of non-negative token ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "pass True or False")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", self.prompt_logprobs,
                      f"pass None (off) or an integer in [0, {MAX_LOGPROBS}] (top alternatives per prompt token)")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", self.logprobs,
                      f"pass None (off) or an integer in [0, {MAX_LOGPROBS}] (top alternatives per generated token)")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "pass an integer >= 0")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "pass a dict {token id: bias}")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise bad("logit_bias", self.logit_bias, f"key {t!r} is not a token id (an integer >= 0)")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    raise bad("logit_bias", self.logit_bias, f"the bias of token {t} is {b!r}: pass a number in "
                                                             f"[-100, 100]")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids or not all(
                    _is_id(t) for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", self.allowed_token_ids,
                          "pass None or a non-empty list of token ids (integers >= 0)")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, (list, tuple)) or not all(
                    isinstance(w, (list, tuple)) and w and all(_is_id(t) for t in w) for w in self.bad_words_token_ids):
                raise bad("bad_words_token_ids", self.bad_words_token_ids,
                          "pass None or a list of non-empty lists of token ids (integers >= 0)")
            self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        self.repetition_penalty = number("repetition_penalty", 1e-6, 1e6,
                                         "pass a number in (0, 1e6] (1 = off)")
        self.frequency_penalty = number("frequency_penalty", -2, 2, "pass a number in [-2, 2]")
        self.presence_penalty = number("presence_penalty", -2, 2, "pass a number in [-2, 2]")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            raise bad("n", self.n, f"pass an integer in [1, {MAX_SAMPLES}]")
        if self.best_of is not None and (isinstance(self.best_of, bool) or not isinstance(self.best_of, int)
                                         or not self.n <= self.best_of <= MAX_SAMPLES):
            raise bad("best_of", self.best_of, f"pass None or an integer in [n={self.n}, {MAX_SAMPLES}]")
        if self.num_samples > 1 and self.max_tokens == 0:
            raise bad("n", self.n, "with max_tokens=0 nothing is sampled: pass n=1 and best_of=None")
        if self.max_tokens and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"it exceeds max_tokens={self.max_tokens}: pass at most that")
        # torch.Generator.manual_seed takes [-2**63, 2**64 - 1], and sample i of a request draws from seed + i
        if self.seed is not None and not -2**63 <= self.seed <= 2**64 - self.num_samples:
            raise bad("seed", self.seed, f"pass an integer in [-2**63, 2**64 - {self.num_samples}] (sample i of "
                                         f"the request draws from seed + i)")
        si = self.stream_interval
        if si is not None and (isinstance(si, bool) or not isinstance(si, int) or si < 1):
            raise bad("stream_interval", self.stream_interval, "pass None or a number of tokens >= 1")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", self.cache_salt, "pass None or a non-empty string")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or not all(isinstance(x, str) and x for x in self.stop)):
            raise bad("stop", self.stop, "pass None, a non-empty string or a list of them")
        self.stop = list(self.stop) if self.stop else None
        if type(self.priority) is not int or not -2**63 <= self.priority < 2**63:
            raise bad("priority", self.priority, "pass an integer in [-2**63, 2**63) (lower is more urgent)")
        gate = self.reasoning_end_token_id
        if gate is not None and (self.structured_outputs is None or type(gate) is not int or gate < 0
                                 or gate in self.stop_token_ids):
            raise bad("reasoning_end_token_id", gate, "pass None, or a token id (an int >= 0, not a stop token: the "
                                                      "output would end there) beside structured_outputs, which bind "
                                                      "after it")
        if self.structured_outputs is not None:
            if (wrong := check_spec(self.structured_outputs)) is not None:
                raise bad("structured_outputs", self.structured_outputs, wrong)
            if isinstance(self.structured_outputs.get("json"), dict):   # as text: msgpack takes no huge integers
                try:
                    text = json.dumps(self.structured_outputs["json"], sort_keys=True)
                except (TypeError, ValueError) as e:
                    raise bad("structured_outputs", self.structured_outputs, f"its json schema is not JSON ({e})")
                self.structured_outputs = dict(self.structured_outputs, json=text)
            if self.ignore_eos:
                raise bad("ignore_eos", self.ignore_eos, "structured_outputs end at EOS once the output is complete: "
                                                         "pass False")
            # each could mask every token the grammar allows (min_tokens its EOS once the output is complete)
            clash = [f for f in ("min_tokens", "allowed_token_ids", "bad_words_token_ids") if getattr(self, f)]
            if clash:
                raise bad(clash[0], getattr(self, clash[0]), "structured_outputs cannot be combined with it (it "
                                                             "could mask every token the grammar allows): leave it out")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def num_samples(self) -> int:
        """How many samples the engine draws (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """True if anything but temperature, top-k and top-p changes this request's logits."""
        return bool(self.reads_history or self.logit_bias or self.allowed_token_ids)

    @property
    def reads_history(self) -> bool:
        """True if this request's logits depend on the tokens before the position (min_tokens, bad words,
        penalties): speculative verification then shapes each draft position's row on its own."""
        return bool(self.min_tokens or self.bad_words_token_ids or self.repetition_penalty != 1.0
                    or self.frequency_penalty or self.presence_penalty or self.structured_outputs)

    def to_dict(self) -> dict:
        """Plain dict for the msgpack control plane."""
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(**d)


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0
