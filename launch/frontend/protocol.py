"""OpenAI-compatible request shapes for the HTTP front (launch/frontend/api_server.py); chat completions' own are
in launch/frontend/chat.py, vLLM's /tokenize and /detokenize bodies in launch/frontend/tokens.py.

Requests are pydantic models in strict mode, so a wrong JSON type is a 400 that names the field, and the
server's OpenAPI schema (which the fuzz test reads) says exactly what is accepted. Fields that OpenAI
defines but this server does not implement are accepted by the schema and refused with a 400 that names
them (`unsupported`), so a client learns what to change instead of getting silently different output.
Fields nobody here defines (other servers' extensions, newer OpenAI fields) are accepted and ignored, at
any depth; `ignored_fields` names them so the server can log them, as vLLM does.
Extensions that vLLM also takes: top_k, min_p, stop_token_ids, ignore_eos, repetition_penalty, min_tokens,
include_stop_str_in_output, stream_options.continuous_usage_stats, allowed_token_ids, bad_words,
skip_special_tokens, spaces_between_special_tokens, add_special_tokens, truncate_prompt_tokens.
"""
from __future__ import annotations

import re
from typing import Annotated, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from attention_nodes.sampling_params import MAX_LOGPROBS, SamplingParams

from ..admission import GENERATION_DEFAULTS

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Seed = Annotated[int, Field(ge=-2**63, lt=2**63)]       # vLLM takes any int64; the engine too
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Bias = Annotated[float, Field(ge=-100, le=100)]


def param_of(error: ValueError) -> str | None:
    """The request field a SamplingParams ValueError names (its "SamplingParams.<field>" prefix), as the client
    sent it: bad_words_token_ids are the front's tokens of bad_words."""
    named = re.search(r"SamplingParams\.(\w+)", str(error))
    return None if named is None else "bad_words" if named.group(1) == "bad_words_token_ids" else named.group(1)


class APIError(Exception):
    """An error answered as OpenAI's {"error": {...}} body with the given HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    """A request body or a part of one: strict types, unknown fields kept aside (`model_extra`)."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """An explicit null for an optional field that cannot hold null means its default, as OpenAI's schema marks
        them nullable and vLLM takes them (e.g. "stream": null, "n": null); a required field's null is still a
        400, and a field that can hold null keeps it."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()
                or type(None) in get_args(fields[k].annotation)}

    def ignored_fields(self) -> list[str]:
        """Dotted paths of the fields sent that no model here defines, nested parts included
        (e.g. "stream_options.foo", "messages.0.reasoning_content")."""
        out = list(self.model_extra or {})
        for name in type(self).model_fields:
            value = getattr(self, name)
            parts = value if isinstance(value, list) else [value]
            for i, part in enumerate(parts):
                if isinstance(part, _Request):
                    where = f"{name}.{i}." if isinstance(value, list) else f"{name}."
                    out += [where + f for f in part.ignored_fields()]
        return out


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: every chunk carries the usage so far


# vLLM's request fields that change the output, which this server does not serve: name -> (the values that change
# nothing, why). Other unknown fields are ignored with a warning.
REFUSED_EXTRAS = {
    "logits_processors": ((None, []), "custom logits processors are not supported; leave logits_processors out"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported; pass a prompt"),
}


class _Sampling(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None         # None: the served model (as vLLM)
    temperature: Annotated[float, Field(ge=0, le=1e6)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=2**31)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None     # vLLM's; None = 0 = off
    n: Annotated[int, Field(ge=1, lt=2**31)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=1e6)] | None = None    # vLLM's; None = 1 = off
    min_tokens: Annotated[int, Field(ge=0, lt=2**31)] = 0
    include_stop_str_in_output: bool = False     # vLLM's: the text keeps the stop string that ended it
    logit_bias: dict[str, Bias] | None = None
    user: str | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None   # vLLM's: only these
    bad_words: list[str] | None = None           # vLLM's: words the output may not contain
    skip_special_tokens: bool = True             # vLLM's: special tokens are left out of the text
    # vLLM's; no effect here: transformers 5's decode has no such option (vLLM's fast-tokenizer path ignores it too)
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None   # vLLM's: keep the prompt's last k tokens
    prompt_logprobs: Annotated[int, Field(lt=2**31)] | None = None   # vLLM's: score the prompt, top k per token
    return_token_ids: bool | None = None         # vLLM's: prompt_token_ids and token_ids beside the text
    cache_salt: str | None = None                # vLLM's: the prefix cache is shared only under the same salt
    priority: Annotated[int, Field(ge=-2**63, lt=2**63)] = 0   # vLLM's: lower first (--scheduling-policy priority)
    stream_interval: Annotated[int, Field(ge=1, lt=2**31)] | None = None   # vLLM's: raises --stream-interval
    use_beam_search: bool = False                # vLLM's: n beams (launch/frontend/beam.py), with its length_penalty
    length_penalty: float = 1.0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or its older guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_tokens_as_token_ids: bool | None = None   # vLLM's: logprobs name each token "token_id:N"

    def ignored_fields(self) -> list[str]:
        """As _Request's, less vLLM's fields that REFUSED_EXTRAS takes at their defaults (vLLM knows them)."""
        return [f for f in super().ignored_fields() if f not in REFUSED_EXTRAS]

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for every set field this server does not implement: its own, and other servers' extensions
        that would change the output (REFUSED_EXTRAS) when set to other than their defaults."""
        out = [(name, why) for name, (defaults, why) in REFUSED_EXTRAS.items()
               if name in (self.model_extra or {}) and self.model_extra[name] not in defaults]
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options is only allowed with stream=true"))
        k = self.prompt_logprobs
        if k is not None and k != 0 and self.stream:     # vLLM takes 0 with stream, and sends nothing for it
            out.append(("prompt_logprobs", f"prompt_logprobs={k} is not available with stream=true (as in vLLM); "
                                           "pass stream=false"))
        elif k is not None and not 0 <= k <= MAX_LOGPROBS:
            whole = " (-1, the whole vocabulary, is not served)" if k == -1 else ""
            out.append(("prompt_logprobs", f"prompt_logprobs={k} is invalid{whole}: pass an integer in "
                                           f"[0, {MAX_LOGPROBS}], the top alternatives per prompt token"))
        return out

    def truncation(self, max_model_len: int) -> int | None:
        """truncate_prompt_tokens checked: how many of the prompt's last tokens to keep (None: all). -1 is
        max_model_len and 0 a 400, as in vLLM; so is more than max_model_len."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k == 0 or k > max_model_len:
            raise APIError(400, f"truncate_prompt_tokens={k} is invalid: pass an integer in [1, max_model_len="
                                f"{max_model_len}], or -1 for max_model_len", "truncate_prompt_tokens")
        return max_model_len if k == -1 else k

    def structured(self) -> tuple[dict | None, str | None]:
        """The engine's structured_outputs (attention_nodes/structured.py) from the one field that sets it, and its
        name: response_format json_object / json_schema (OpenAI's), structured_outputs, or vLLM's older
        guided_json, guided_regex, guided_choice and guided_grammar. A 400 when several do, or for what is not
        served (another response_format type, vLLM's structural_tag and whitespace_pattern)."""
        given = []
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            schema = rf.get("json_schema")
            schema = schema.get("schema") if isinstance(schema, dict) else None
            if rf.get("type") == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif rf.get("type") == "json_schema" and isinstance(schema, dict):
                given.append(("response_format", {"json": schema}))
            else:
                raise APIError(400, f"response_format {rf!r} is not served: pass {{\"type\": \"text\"}}, "
                                    f"{{\"type\": \"json_object\"}} or {{\"type\": \"json_schema\", \"json_schema\": "
                                    f"{{\"schema\": {{...}}}}}}", "response_format")
        if self.structured_outputs is not None:
            # vLLM's flags that change nothing here go (a fallback backend, its private fields), as do nulls
            spec = {k: v for k, v in self.structured_outputs.items() if v is not None and not k.startswith("_")
                    and k != "disable_fallback" and not (k == "disable_additional_properties" and v is False)}
            for key in ("structural_tag", "whitespace_pattern", "disable_additional_properties"):
                if key in spec:
                    raise APIError(400, f"structured_outputs.{key} is not supported; use json, json_object, regex, "
                                        f"choice or grammar", f"structured_outputs.{key}")
            given.append(("structured_outputs", spec))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if (value := getattr(self, name)) is not None:
                given.append((name, {name[len("guided_"):]: value}))
        if len(given) > 1:
            raise APIError(400, f"{given[0][0]} and {given[1][0]} both constrain the output; pass one of them",
                           given[1][0])
        return (given[0][1], given[0][0]) if given else (None, None)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise APIError(400, "stop strings must not be empty", "stop")
        return stops

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) to ask the engine for: None = none, k = the token plus the top k."""
        return None, self.prompt_logprobs

    def sample_counts(self) -> tuple[int, int | None]:
        """(n, best_of): choices per prompt, and how many samples to draw for them (None = n)."""
        return self.n, None

    def token_bias(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with its keys (token ids as strings, OpenAI's form) as ints; a 400 naming logit_bias for a
        key that is not a token id of this vocabulary."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
                raise APIError(400, f"logit_bias has the key {key!r}, which is not a token id in [0, {vocab_size})",
                               "logit_bias")
            out[int(key)] = bias
        return out

    def sampling_params(self, max_tokens: int, vocab_size: int, defaults: tuple = (),
                        bad_words: list[list[int]] | None = None) -> SamplingParams:
        """The engine's parameters (stop strings are the front's job, not the engine's). defaults: the
        checkpoint's (generation_defaults) for the fields left out; bad_words: `bad_words` as token ids. A 400
        naming the field for a value the engine refuses."""
        given = dict(defaults) | {k: getattr(self, k) for k in GENERATION_DEFAULTS if getattr(self, k) is not None}
        top_k = given["top_k"] if given.get("top_k", 0) > 0 else 0
        if self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={self.min_tokens} exceeds max_tokens={max_tokens}; lower min_tokens",
                           "min_tokens")
        logprobs, prompt_logprobs = self.logprob_counts()
        n, best_of = self.sample_counts()
        structured, field_name = self.structured()
        try:
            if max_tokens == 0:   # nothing is sampled: one engine sample serves every choice (the front repeats it)
                SamplingParams(n=n, best_of=best_of)     # still a 400 for values the engine refuses
                n, best_of = 1, None
            return SamplingParams(
                max_tokens=max_tokens, temperature=given.get("temperature", 1.0), top_p=given.get("top_p", 1.0),
                top_k=top_k, min_p=given.get("min_p", 0.0), seed=self.seed,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=given.get("repetition_penalty", 1.0),
                min_tokens=self.min_tokens, logit_bias=self.token_bias(vocab_size), n=n, best_of=best_of,
                allowed_token_ids=self.allowed_token_ids, bad_words_token_ids=bad_words or None,
                structured_outputs=structured, cache_salt=self.cache_salt, priority=self.priority,
                stream_interval=self.stream_interval)
        except ValueError as e:
            param = param_of(e)
            raise APIError(400, str(e), field_name if param == "structured_outputs" else param) from e


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16     # 0 only with echo or prompt_logprobs (scored prompt)
    echo: bool = False
    logprobs: NumLogprobs | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True      # vLLM's: a string prompt gets the tokenizer's special tokens (its BOS)

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.stream and self.best_of is not None and self.best_of > self.n:
            out.append(("best_of", f"best_of={self.best_of} > n={self.n} cannot stream (the best samples are known "
                                   "only once all have finished, as in OpenAI's API); pass stream=false or "
                                   "best_of=n"))
        if self.suffix is not None:
            out.append(("suffix", "suffix is not supported; leave it out"))
        return out

    def sample_counts(self) -> tuple[int, int | None]:
        return self.n, self.best_of

    def limit(self) -> int | None:
        """max_tokens, checked: 0 needs echo or prompt_logprobs (there is nothing else to return); left out, 16
        (OpenAI's default); null, None: all the room each prompt leaves (vLLM's)."""
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise APIError(400, "max_tokens=0 is only allowed with echo=true or prompt_logprobs (the prompt comes "
                                "back scored); pass max_tokens >= 1", "max_tokens")
        return self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """With echo, the prompt is scored too: always when max_tokens is 0 (the engine scores the prompt or
        does nothing), else when logprobs are asked for. With prompt_logprobs as well, the engine's k is the
        larger of the two (each answer keeps its own)."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        if self.echo and self.max_tokens == 0 and not asked:
            asked = [0]
        return self.logprobs, max(asked, default=None)

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch; each becomes n choices."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty: pass a string, a list of token ids, or a list of either",
                           "prompt")
        return list(p)


class DrainRequest(_Request):
    """POST /admin/drain: {"ranks": [rank, ...]} or {"hosts": [hostname, ...]} (every rank on those hosts, as
    a pod's preStop hook names its own): they leave the job between steps (a retired attention rank hands its
    requests over; a retired expert rank's experts are re-placed) and exit."""

    ranks: Annotated[list[int], Field(min_length=1)] | None = None
    hosts: Annotated[list[str], Field(min_length=1)] | None = None

    def check(self) -> None:
        if (self.ranks is None) == (self.hosts is None):
            raise APIError(400, "pass exactly one of 'ranks' (rank numbers) and 'hosts' (hostnames)", "ranks")
