"""Request shapes (launch/frontend/protocol.py) without a server: explicit nulls, a checkpoint's sampling defaults."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from launch.admission import generation_defaults
from launch.frontend.chat import ChatCompletionRequest
from launch.frontend.protocol import CompletionRequest


def test_null_for_an_optional_field_means_its_default():
    """OpenAI's schema marks stream, n, echo and chat's logprobs nullable; vLLM takes null as the default."""
    got = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": None, "n": None, "echo": None,
                                            "ignore_eos": None, "min_tokens": None, "max_tokens": None})
    assert (got.stream, got.n, got.echo, got.ignore_eos, got.min_tokens) == (False, 1, False, False, 0)
    assert got.max_tokens is None           # a field that can hold null keeps it (the server: all that fits)
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "logprobs": None, "add_generation_prompt": None})
    assert (chat.logprobs, chat.add_generation_prompt) == (False, True)


@pytest.mark.parametrize("body", [{"model": "m", "prompt": None}, {"prompt": None}])
def test_null_for_a_required_field_is_refused_by_name(body):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    assert {err["loc"][0] for err in e.value.errors()} == {next(k for k, v in body.items() if v is None)}


def test_a_checkpoints_generation_config_gives_the_sampling_defaults(tmp_path):
    """As vLLM's --generation-config auto: the temperature, top_p, top_k, min_p and repetition_penalty that a
    checkpoint's generation_config.json sets apply to requests that leave them out; a request's own win."""
    from transformers import GenerationConfig
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1,
                     eos_token_id=2).save_pretrained(tmp_path / "set")
    GenerationConfig(eos_token_id=2).save_pretrained(tmp_path / "plain")
    defaults = generation_defaults(str(tmp_path / "set"))
    body = CompletionRequest.model_validate({"prompt": "hi"})
    p = body.sampling_params(8, 100, defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.95, 20, 0.05, 1.1)
    own = CompletionRequest.model_validate({"prompt": "hi", "temperature": 0, "top_k": -1, "top_p": 0.5, "min_p": 0})
    p = own.sampling_params(8, 100, defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0, 0.5, 0, 0, 1.1)
    for plain in (generation_defaults(str(tmp_path / "plain")), generation_defaults(str(tmp_path))):
        p = body.sampling_params(8, 100, plain)
        assert plain == () and (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0, 1)
