"""--stream-interval (the app's stream_interval; vLLM's flag): a streamed answer's first chunk carries the first
token, later chunks at least N new tokens, the last what is left with the finish reason; the tokens, text and
logprobs put together are what an unstreamed answer and transformers' greedy continuation give. On an in-process
server (tests/launch/frontend/in_process.py) over the tiny checkpoint, 1+1 ranks."""
from __future__ import annotations

import pytest
from conftest import hf_greedy, make_prompts

from launch import LLM
from tests.launch.frontend.in_process import serving
from tests.launch.frontend.test_http_logprobs import post

MODEL = "tiny"
INTERVAL = 4


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    with LLM(path, attention_ranks=1, expert_ranks=1) as llm, \
            serving(llm, path, MODEL, stream_interval=INTERVAL) as (port, _):
        class Served:
            pass
        Served.port, Served.path = port, path
        yield Served


@pytest.mark.parametrize("max_tokens", [10, 13, 1])
def test_chunks_carry_the_interval_and_add_up_to_the_answer(served, max_tokens):
    prompt = make_prompts(1, 256, 9, 9, seed=71)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "n": 2, "return_token_ids": True}
    code, chunks = post(served, "/v1/completions", {**body, "stream": True})
    assert code == 200, chunks
    code, whole = post(served, "/v1/completions", body)
    assert code == 200, whole
    want = hf_greedy(served.path, [prompt], max_tokens)[0]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        sizes = [len(c.get("token_ids") or []) for c in mine]
        sizes = [s for s in sizes if s]
        rest = max_tokens - 1
        # the first token alone, then whole intervals, then what is left (with the finish reason)
        assert sizes == [1] + [INTERVAL] * (rest // INTERVAL) + ([rest % INTERVAL] if rest % INTERVAL else []), sizes
        assert [t for c in mine for t in c.get("token_ids") or []] == want
        assert mine[-1]["finish_reason"] == "length"
        answer = whole["choices"][index]
        assert "".join(c["text"] for c in mine) == answer["text"]
        assert [x for c in mine for x in c["logprobs"]["token_logprobs"]] == \
            answer["logprobs"]["token_logprobs"]


def test_a_bad_interval_is_refused_with_its_value():
    from launch.frontend.api_server import build_app
    with pytest.raises(ValueError, match=r"stream_interval=0 is invalid: pass a number of tokens >= 1"):
        build_app(MODEL, "/m", stream_interval=0)
