"""Request shapes (launch/frontend/protocol.py) without a server: explicit nulls."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from launch.frontend.protocol import ChatCompletionRequest, CompletionRequest


def test_null_for_an_optional_field_means_its_default():
    """OpenAI's schema marks stream, n, echo and chat's logprobs nullable; vLLM takes null as the default."""
    got = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": None, "n": None, "echo": None,
                                            "ignore_eos": None, "min_tokens": None, "max_tokens": None})
    assert (got.stream, got.n, got.echo, got.ignore_eos, got.min_tokens) == (False, 1, False, False, 0)
    assert got.max_tokens is None           # a field that can hold null keeps it (the server: all that fits)
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "logprobs": None, "add_generation_prompt": None})
    assert (chat.logprobs, chat.add_generation_prompt) == (False, True)


@pytest.mark.parametrize("body", [{"model": None, "prompt": "hi"}, {"model": "m", "prompt": None}])
def test_null_for_a_required_field_is_refused_by_name(body):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    assert {err["loc"][0] for err in e.value.errors()} == {next(k for k, v in body.items() if v is None)}
