"""Text <-> token ids for the HTTP front: prompts and chats as the completions endpoints see them, and vLLM's
/tokenize and /detokenize, which show a client exactly those ids."""
from __future__ import annotations

import inspect
from typing import Annotated

from pydantic import Field

from .chat import ChatMessage, Tool, conversation, template_tools
from .protocol import APIError, TokenId, _Request


class TokenizeRequest(_Request):
    """POST /tokenize, vLLM's two shapes in one model: {"prompt"} (its TokenizeCompletionRequest) or
    {"messages"} (its TokenizeChatRequest, through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None   # None: True for a prompt, False for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None     # vLLM's, as on chat
    documents: list[dict] | None = None
    tools: list[Tool] | None = None              # vLLM's: they reach the chat template, as on chat

    def check(self) -> None:
        """A 400 unless exactly one of prompt and messages is given, with template options that agree."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "pass exactly one of 'prompt' (a string) and 'messages' (a chat)",
                           "prompt" if self.prompt is not None else "messages")
        if self.messages is not None and self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true; set "
                                "add_generation_prompt to false", "continue_final_message")
        chat_only = {"chat_template_kwargs": self.chat_template_kwargs is not None,
                     "documents": self.documents is not None, "tools": self.tools is not None,
                     "add_generation_prompt": not self.add_generation_prompt,
                     "continue_final_message": self.continue_final_message}
        if self.prompt is not None and (given := [k for k, v in chat_only.items() if v]):
            raise APIError(400, f"{given[0]} shapes a chat template's text, and this request tokenizes a prompt; pass "
                                f"messages instead of prompt, or leave {given[0]} out", given[0])

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools)


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's shape): token ids -> {"prompt": text}."""

    model: str | None = None
    tokens: list[TokenId]


def prompt_ids(llm, prompt, param: str, add_special_tokens: bool = True, truncate: int | None = None) -> list[int]:
    """A prompt (string or ids) -> checked ids (Admission.prompt_ids); a 400 naming `param` when it is bad."""
    try:
        return llm.admission.prompt_ids(prompt, add_special_tokens, truncate)
    except ValueError as e:
        raise APIError(400, str(e), param) from e


def was_cut(tok, prompt, kept: list[int], add_special_tokens: bool) -> bool:
    """Whether truncation left fewer tokens of `prompt` (a string, or ids) than it has."""
    whole = tok.encode(prompt, add_special_tokens=add_special_tokens) if isinstance(prompt, str) else prompt
    return len(whole) > len(kept)


def bad_words_ids(tok, words: list[str] | None) -> list[list[int]]:
    """vLLM's bad_words as token id sequences, by its rule: each word (leading spaces stripped) as the start of the
    text, and with one leading space (mid-text) when that is a distinct token sequence of the same length; a 400
    for an empty word or without a tokenizer."""
    if not words:
        return []
    if tok is None:
        raise APIError(400, "bad_words needs the model's tokenizer, and this model has none", "bad_words")
    out = []
    for word in words:
        if not word.strip():
            raise APIError(400, f"bad_words has the empty word {word!r}; pass words with text in them", "bad_words")
        alone = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        if not alone or not spaced:
            raise APIError(400, f"bad_words has {word!r}, which the tokenizer turns into no tokens", "bad_words")
        out.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return out


def chat_ids(tok, body, model_name: str, continue_final: bool = False, add_special_tokens: bool = False
             ) -> list[int]:
    """body's messages through the tokenizer's chat template -> ids (chat_text's, tokenized)."""
    return tok.encode(chat_text(tok, body, model_name, continue_final), add_special_tokens=add_special_tokens)


# apply_chat_template's own arguments that chat_template_kwargs may set (vLLM's); its others it may not
_TEMPLATE_OPTIONS = frozenset({"add_generation_prompt", "continue_final_message", "documents"})


def template_kwargs(tok, body) -> dict:
    """vLLM's chat_template_kwargs (variables the chat template reads, e.g. Qwen3's enable_thinking; they may also
    set add_generation_prompt or continue_final_message) and documents (RAG templates read them), checked; and chat's
    reasoning_effort (GPT-OSS's template reads it), which sets enable_thinking too unless the kwargs do."""
    extra = dict(body.chat_template_kwargs or {})
    own = set(inspect.signature(tok.apply_chat_template).parameters) - _TEMPLATE_OPTIONS - {"kwargs"}
    taken = sorted(set(extra) & own)
    if taken:
        raise APIError(400, f"chat_template_kwargs sets {taken[0]!r}, which is not a chat template variable; leave "
                            f"it out", "chat_template_kwargs")
    if body.documents is not None:
        extra["documents"] = body.documents
    if (effort := getattr(body, "reasoning_effort", None)) is not None:     # vLLM's rule (chat only)
        extra["reasoning_effort"] = effort
        extra.setdefault("enable_thinking", effort != "none")
    return extra


def chat_text(tok, body, model_name: str, continue_final: bool = False, template: str | None = None) -> str:
    """body's messages through the tokenizer's chat template (or `template`'s text) -> text (a 400 when the model
    has no template or the template rejects them). `body` has conversation(), template_tools() and
    add_generation_prompt; `continue_final` leaves the last message open (no end-of-turn), for the model to
    continue."""
    if tok is None or not (template or getattr(tok, "chat_template", None)):
        raise APIError(400, f"model {model_name!r} has no tokenizer chat template; use /v1/completions")
    options = {"add_generation_prompt": body.add_generation_prompt} | (
        {"continue_final_message": True} if continue_final else {}) | template_kwargs(tok, body) | (
        {"chat_template": template} if template else {})
    if (tools := body.template_tools()) is not None:
        options["tools"] = tools
    messages = body.conversation()
    try:
        text = tok.apply_chat_template(messages, tokenize=False, **options)
    except Exception as e:   # a template may reject a conversation (roles, order): the client's to fix
        raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from e
    return text


def tokenize(llm, body: TokenizeRequest, model_name: str) -> dict:
    """vLLM's TokenizeResponse: {"count", "max_model_len", "tokens"} (+ "token_strs" when asked)."""
    body.check()
    tok = llm.tokenizer
    if tok is None:
        raise APIError(400, f"model {model_name!r} has no tokenizer; /tokenize needs one")
    if body.messages is not None:
        special = bool(body.add_special_tokens)
        ids = chat_ids(tok, body, model_name, body.continue_final_message, add_special_tokens=special)
    else:
        special = body.add_special_tokens is not False
        ids = tok.encode(body.prompt, add_special_tokens=special)
    out = {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


def detokenize(llm, body: DetokenizeRequest, model_name: str) -> dict:
    """vLLM's DetokenizeResponse: {"prompt"}, special tokens included (what /tokenize counted)."""
    if llm.tokenizer is None:
        raise APIError(400, f"model {model_name!r} has no tokenizer; /detokenize needs one")
    vocab = llm.spec.vocab_size
    bad = [(i, t) for i, t in enumerate(body.tokens) if t >= vocab]
    if bad:
        i, t = bad[0]
        raise APIError(400, f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab})", "tokens")
    try:
        return {"prompt": llm.tokenizer.decode(body.tokens, skip_special_tokens=False)}
    except (IndexError, KeyError, ValueError, OverflowError) as e:   # ids past the tokenizer's own table
        raise APIError(400, f"the tokenizer cannot decode these tokens: {type(e).__name__}: {e}", "tokens") from e
