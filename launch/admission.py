"""What a request must be before it is queued: its prompt as checked token ids, and sampling parameters the
engine can serve (within max_model_len, one attention rank's KV cache, max_num_seqs and the vocabulary). Both
fronts use it: `LLM.generate`/`submit` and the HTTP front (launch/frontend/), which turns each ValueError
into a 400 naming the field."""
from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

from attention_nodes.sampling_params import SamplingParams
from attention_nodes.structured import Grammars

GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@functools.lru_cache(maxsize=8)
def generation_defaults(model_dir: str) -> tuple[tuple[str, float], ...]:
    """The sampling defaults a checkpoint's generation_config.json sets (those of GENERATION_DEFAULTS that
    differ from transformers' own), for requests that leave them out: vLLM's --generation-config auto."""
    if not os.path.exists(os.path.join(model_dir, "generation_config.json")):
        return ()
    from transformers import GenerationConfig
    set_here = GenerationConfig.from_pretrained(model_dir, local_files_only=True).to_diff_dict()
    return tuple((k, set_here[k]) for k in GENERATION_DEFAULTS if set_here.get(k) is not None)


def sampling_defaults(config) -> tuple[tuple[str, float], ...]:
    """The sampling defaults an engine's `generation_config` option gives (EngineConfig): auto, the checkpoint's;
    vllm, none; else those of the directory it names."""
    source = config.generation_config
    return () if source == "vllm" else generation_defaults(config.model if source == "auto" else source)


PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")     # of vLLM's TextPrompt and TokensPrompt, those served
# vLLM's prompt options for inputs not served here: taken when unset (None or empty), as vLLM acts only on set ones
UNSERVED_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "media_io_kwargs", "token_type_ids",
                 "prompt_token_offsets")


@dataclass(frozen=True, slots=True)
class PromptInput:
    """One prompt as `LLM.generate` takes it: its checked token ids, its text when the caller gave one (vLLM's
    RequestOutput.prompt: None for token ids alone) and the cache salt a prompt dict carries."""

    ids: list[int]
    text: str | None = None
    cache_salt: str | None = None


def prompt_list(prompts) -> list:
    """`LLM.generate`'s prompts -> a list of prompts: one prompt (a string, token ids, or a vLLM prompt dict) or a
    non-empty list of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts={prompts!r} is empty or not a list; pass at least one prompt")
    return list(prompts)


class Admission:
    """The checks of one engine, once its limits are known (the leader's start-up report)."""

    def __init__(self, tokenizer, vocab_size: int, max_num_seqs: int, max_model_len: int, kv_capacity_tokens: int,
                 eos_token_ids: tuple[int, ...] = (), scheduling_policy: str = "fcfs"):
        self.tokenizer, self.vocab_size, self.max_num_seqs = tokenizer, vocab_size, max_num_seqs
        self.scheduling_policy = scheduling_policy
        self.max_model_len, self.kv_capacity_tokens = max_model_len, kv_capacity_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()

    def prompt_ids(self, prompt, add_special_tokens: bool = True, truncate: int | None = None) -> list[int]:
        """A prompt (string or token ids) -> checked token ids; ValueError names what is wrong. A string is
        tokenized with the tokenizer's special tokens (its BOS, if it adds one) unless add_special_tokens is
        False. truncate (>= 1; vLLM's truncate_prompt_tokens): at most that many tokens, cut from the left; a
        string keeps the special tokens the tokenizer adds (as vLLM tokenizes it: truncation on the left)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {prompt[:40]!r} is a string but this model has no tokenizer; pass token ids")
            ids = self._encode(prompt, add_special_tokens, truncate)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = list(prompt) if truncate is None else list(prompt[-truncate:])
        else:
            raise ValueError(f"prompt {str(prompt)[:60]!r} is neither a string nor a list of token ids")
        if not ids:
            raise ValueError("empty prompt: pass at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def prompt_input(self, prompt) -> PromptInput:
        """A prompt of `LLM.generate` -> its PromptInput. Besides a string or token ids, vLLM's prompt dicts:
        TextPrompt {"prompt": text} and TokensPrompt {"prompt_token_ids": ids} (its "prompt", if any, is only
        the text returned with it, as vLLM's), each with an optional "cache_salt". Keys for inputs this engine
        does not serve (multi-modal data, embeddings) are refused by name."""
        if not isinstance(prompt, dict):
            return PromptInput(self.prompt_ids(prompt), prompt if isinstance(prompt, str) else None)
        for k, v in prompt.items():
            if k in UNSERVED_KEYS and v is not None and (not hasattr(v, "__len__") or len(v)):
                raise ValueError(f"prompt dict's {k!r} is set, and this engine serves text-only models; leave it out")
            if k not in PROMPT_KEYS + UNSERVED_KEYS:
                raise ValueError(f"prompt dict's key {k!r} is unknown or not served: pass {', '.join(PROMPT_KEYS)}")
        text, salt = prompt.get("prompt"), prompt.get("cache_salt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt dict's 'prompt' {text!r} is not a string")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"prompt dict's 'cache_salt' {salt!r} is invalid: pass a non-empty string")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, str) or not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompt dict's 'prompt_token_ids' {str(ids)[:60]!r} is not a list of token ids")
            ids = self.prompt_ids(list(ids))
        elif text is None:
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids)")
        else:
            ids = self.prompt_ids(text)
        return PromptInput(ids, text, salt)

    def prompt_inputs(self, prompts) -> list[PromptInput]:
        """`LLM.generate`'s prompts (prompt_list's forms) -> their PromptInputs; a ValueError names the prompt at
        fault (prompts[i]) when there are several."""
        prompts = prompt_list(prompts)
        out = []
        for i, p in enumerate(prompts):
            try:
                out.append(self.prompt_input(p))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}" if len(prompts) > 1 else str(e)) from e
        return out

    def _encode(self, text: str, add_special_tokens: bool, truncate: int | None) -> list[int]:
        tok = self.tokenizer
        if truncate is None:
            return tok.encode(text, add_special_tokens=add_special_tokens)
        # transformers takes the side only as the tokenizer's attribute: set for this call (callers share no
        # tokenizer across threads: the HTTP front tokenizes on its event loop)
        side, tok.truncation_side = tok.truncation_side, "left"
        try:
            return tok(text, add_special_tokens=add_special_tokens, truncation=True, max_length=truncate)["input_ids"]
        finally:
            tok.truncation_side = side

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """ValueError unless the request's samples fit max_num_seqs (`check_samples`), its token ids leave
        something to sample (`check_tokens`) and it fits (`check_fits`)."""
        self.check_samples(params)
        self.check_priority(params)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop={params.stop!r} needs the model's tokenizer, and this checkpoint "
                             f"has none: pass stop_token_ids instead")
        self.check_tokens(params)
        self.check_structured(params)
        self.check_fits(ids, params)

    def check_fits(self, ids: list[int], params: SamplingParams) -> None:
        """ValueError unless prompt + max_tokens fits max_model_len and one attention rank's KV cache."""
        need = len(ids) + params.max_tokens
        if need > self.max_model_len:  # max_tokens >= 1, so this also covers len(ids) >= max_model_len
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} = {need} exceeds "
                             f"max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens")
        if need > self.kv_capacity_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} = {need} exceeds the KV "
                             f"cache of one attention rank ({self.kv_capacity_tokens} tokens); give more "
                             f"kv_cache_memory or shorten the request")

    def check_structured(self, params: SamplingParams) -> None:
        """ValueError naming structured_outputs unless its grammar compiles against this model's tokenizer (the
        ranks compile it again, from the same spec)."""
        spec = params.structured_outputs
        if spec is None:
            return
        if self.tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs the model's tokenizer, and this checkpoint has "
                             "none; add its tokenizer files or leave structured_outputs out")
        with self._grammars_lock:      # the HTTP front checks from worker threads
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._grammars.compile(spec)

    def check_priority(self, params: SamplingParams) -> None:
        """ValueError naming priority when one is set but the engine does not schedule by it."""
        if params.priority and self.scheduling_policy != "priority":
            raise ValueError(f"SamplingParams.priority={params.priority} needs scheduling_policy='priority', and "
                             f"this engine schedules by {self.scheduling_policy!r}: start it with "
                             f"scheduling_policy='priority' (--scheduling-policy priority) or leave priority at 0")

    def check_samples(self, params: SamplingParams) -> None:
        """ValueError unless the request's samples (side by side) fit max_num_seqs: else they would wait forever."""
        if params.num_samples > self.max_num_seqs:
            raise ValueError(f"n={params.n}, best_of={params.best_of}: {params.num_samples} samples exceed "
                             f"max_num_seqs={self.max_num_seqs}; draw fewer or raise max_num_seqs")

    def check_tokens(self, params: SamplingParams) -> None:
        """ValueError naming the field for a token id outside the vocabulary where one would change the output:
        allowed_token_ids (vLLM refuses those too), bad_words_token_ids and reasoning_end_token_id (its grammar would
        never bind; an EOS id neither). Such ids elsewhere, stop_token_ids or logit_bias, can never be sampled and
        are left alone. Also for allowed_token_ids that leave nothing to sample: each a one-token bad word or, under
        min_tokens, a stop token or EOS (every logit would be -inf)."""
        named = [("allowed_token_ids", params.allowed_token_ids or []),
                 ("bad_words_token_ids", [t for w in params.bad_words_token_ids or [] for t in w]),
                 ("reasoning_end_token_id", [] if params.reasoning_end_token_id is None
                  else [params.reasoning_end_token_id])]
        for name, ids in named:
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token id {bad[0]}, outside the vocabulary "
                                 f"[0, {self.vocab_size}); pass ids below {self.vocab_size}")
        if params.reasoning_end_token_id in self.eos_token_ids:
            raise ValueError(f"SamplingParams.reasoning_end_token_id={params.reasoning_end_token_id} is an EOS id: "
                             f"the output would end there and its grammar never bind; pass the end-of-reasoning "
                             f"token's id")
        if params.allowed_token_ids:
            banned = {w[0] for w in params.bad_words_token_ids or [] if len(w) == 1}
            if params.min_tokens:
                banned |= set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            if set(params.allowed_token_ids) <= banned:
                raise ValueError(f"SamplingParams.allowed_token_ids ({len(params.allowed_token_ids)} ids) leaves "
                                 f"nothing to sample: each is a one-token bad word, or a stop token or EOS that "
                                 f"min_tokens holds back; allow other tokens")
