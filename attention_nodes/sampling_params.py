"""Per-request sampling parameters, checked once at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # the most top alternatives a request may ask for per position (vLLM's default cap)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 disable those filters.
    seed makes sampling reproducible per request, whatever else is in the batch.
    stop_token_ids end generation like EOS does (the stop token is kept in the output).
    ignore_eos keeps generating past EOS until max_tokens.
    prompt_logprobs: None (off) or k >= 0: return each prompt token's log-probability given the tokens before
        it, plus the k most likely tokens at that position (vLLM's meaning). The first prompt token has none.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, value, want: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r} is invalid: {want}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "pass an integer >= 1")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not (0.0 <= float(self.temperature) < float("inf")):
            raise bad("temperature", self.temperature, "pass a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not (0.0 < float(self.top_p) <= 1.0):
            raise bad("top_p", self.top_p, "pass a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "pass an integer >= 0 (0 = disabled)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", self.seed, "pass an integer or None")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "pass a list of non-negative token ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "pass True or False")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", self.prompt_logprobs,
                      f"pass None (off) or an integer in [0, {MAX_LOGPROBS}] (top alternatives per prompt token)")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        """Plain dict for the msgpack control plane."""
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(**d)
