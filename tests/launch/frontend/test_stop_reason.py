"""A completion's stop_reason and text at its end, as vLLM sets them, driven through `respond` with engine rows made
here: the tokenizer's EOS ends with stop_reason null (unless ignore_eos, where it is only a stop token id), the
checkpoint's other EOS ids and stop token ids are named, and the token that ended the choice is not in its text
unless include_stop_str_in_output."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from launch.frontend.engine_client import Progress
from launch.frontend.generate import respond
from launch.frontend.protocol import CompletionRequest
from models.tiny import save_tiny_tokenizer

OTHER_EOS = 50      # an EOS id the checkpoint's generation_config adds to the tokenizer's


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


class Engine:
    """Answers each request with one row: `tokens`, finished "stop"."""

    def __init__(self, tok, tokens: list[int]):
        self.llm = SimpleNamespace(tokenizer=tok, spec=SimpleNamespace(eos_token_ids=(tok.eos_token_id, OTHER_EOS)))
        self.tokens = tokens

    def submit(self, ids, params, sink):
        sink.put_nowait(Progress("r0", self.tokens, "stop"))
        return "r0"

    def release(self, rid, reason):
        pass

    def finished(self, rid, reason):
        pass


def complete(tok, tokens: list[int], **fields) -> dict:
    body = CompletionRequest.model_validate({"prompt": [5], **fields})
    params = body.sampling_params(16, 320)

    async def not_gone():
        return False

    request = SimpleNamespace(state=SimpleNamespace(), is_disconnected=not_gone)
    out = asyncio.run(respond("m", Engine(tok, tokens), body, request, [[5]], [params], chat=False))
    return out["choices"][0]


def test_stop_reason_and_the_last_tokens_text(tok):
    eos, text = tok.eos_token_id, tok.encode("Hello experts")
    cases = [  # (fields, the stopping token, stop_reason)
        ({}, eos, None),
        ({}, OTHER_EOS, OTHER_EOS),                       # vLLM adds the checkpoint's other EOS ids to the stop ids
        ({"stop_token_ids": [eos]}, eos, None),
        ({"stop_token_ids": [eos], "ignore_eos": True}, eos, eos),
        ({"stop_token_ids": [text[1]]}, text[1], text[1]),
    ]
    for fields, last, reason in cases:
        for keep in (False, True):
            got = complete(tok, text + [last], include_stop_str_in_output=keep, skip_special_tokens=False, **fields)
            want = tok.decode(text + [last] if keep else text, skip_special_tokens=False)
            assert (got["text"], got["finish_reason"], got["stop_reason"]) == (want, "stop", reason), (fields, keep)
