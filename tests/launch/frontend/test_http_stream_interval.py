"""--stream-interval (the app's stream_interval; vLLM's flag): a streamed answer's first chunk carries the first
token, later chunks at least N new tokens, the last what is left with the finish reason; the tokens, text and
logprobs put together are what an unstreamed answer and transformers' greedy continuation give. On an in-process
server (tests/launch/frontend/in_process.py) over the tiny checkpoint, 1+1 ranks."""
from __future__ import annotations

import pytest
from conftest import hf_greedy, make_prompts

from launch import LLM, SamplingParams
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


@pytest.mark.parametrize("max_tokens,asked,interval", [(10, None, INTERVAL), (13, None, INTERVAL), (1, None, INTERVAL),
                                                       (15, 6, 6), (10, 2, INTERVAL)])
def test_chunks_carry_the_interval_and_add_up_to_the_answer(served, max_tokens, asked, interval):
    """asked: the request's own stream_interval (vLLM's: it raises the server's, never lowers it)."""
    prompt = make_prompts(1, 256, 9, 9, seed=71)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "n": 2, "return_token_ids": True}
    body |= {} if asked is None else {"stream_interval": asked}
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
        assert sizes == [1] + [interval] * (rest // interval) + ([rest % interval] if rest % interval else []), sizes
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


def test_a_chats_own_interval_streams_its_answer_so(served):
    """/v1/chat/completions takes the request's stream_interval too: deltas of 1, then 5 tokens at a time."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(served.path)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 11, "temperature": 0,
            "ignore_eos": True, "stream_interval": 5, "stream": True, "return_token_ids": True}
    code, chunks = post(served, "/v1/chat/completions", body)
    assert code == 200, chunks
    sizes = [len(c["choices"][0].get("token_ids") or []) for c in chunks if c["choices"]]
    assert [n for n in sizes if n] == [1, 5, 5], sizes
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("bad", [0, -3, "two", 1.5])
def test_a_requests_bad_interval_is_a_400_naming_it(served, bad):
    prompt = make_prompts(1, 256, 9, 9, seed=71)[0]
    code, body = post(served, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                  "stream_interval": bad})
    assert code == 400, body
    assert body["error"]["param"] == "stream_interval", body
    with pytest.raises(ValueError, match=r"SamplingParams\.stream_interval=0 is invalid: pass None or a number"):
        SamplingParams(stream_interval=0)
