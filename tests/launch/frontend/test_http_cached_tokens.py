"""Prompt tokens found in the prefix cache, as the answers' usage reports them: chat and completions'
prompt_tokens_details.cached_tokens and Anthropic's cache_read_input_tokens with --enable-prompt-tokens-details
(the app's prompt_tokens_details; vLLM's flag), and /v1/responses' input_tokens_details.cached_tokens always. On an
in-process server (the app on uvicorn in a thread, attached to one `LLM` on 1+1 spawned ranks) over the tiny
checkpoint, prefix caching on, 16-token blocks.

Oracle: the test's own count from the token ids of the prompts it sent before (the chat template's ids computed
by the test), by prefix caching's rule: the whole blocks a prompt shares with an earlier one from its start, never
the block that holds its last token (that one is always computed). The pool is large enough that nothing is
evicted, and every test's prompts start differently, so only a test's own earlier prompts count."""
from __future__ import annotations

import http.client
import json

import pytest
from conftest import make_prompts

from launch import LLM
from tests.launch.frontend.in_process import serving
from tests.launch.frontend.test_http_logprobs import chat_ids, post

MODEL = "tiny"
BLOCK = 16


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    with LLM(path, attention_ranks=1, expert_ranks=1, block_size=BLOCK, max_model_len=256) as llm, \
            serving(llm, path, MODEL, prompt_tokens_details=True) as (port, _):
        class Served:
            tokenizer = llm.tokenizer
        Served.port = port
        yield Served


def cached(prompt: list[int], earlier: list[list[int]]) -> int:
    """The tokens of prompt that earlier prompts' cached blocks hold (the oracle)."""
    def shared(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    most = max((shared(prompt, e) for e in earlier), default=0)
    return min(most // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK


def completion(served, **fields) -> dict:
    code, data = post(served, "/v1/completions", {"model": MODEL, "max_tokens": 3, "temperature": 0, **fields})
    assert code == 200, data
    return data


def test_completions_report_the_prompt_tokens_found_cached(served):
    a, b = make_prompts(2, 256, 40, 45, seed=901)
    sent: list[list[int]] = []
    for prompts in ([a], [a], [a, b], [b]):
        got = completion(served, prompt=prompts if len(prompts) > 1 else prompts[0])
        want = sum(cached(p, sent + prompts[:i]) for i, p in enumerate(prompts))
        assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": want}, (len(sent), got["usage"])
        sent += prompts
    assert [cached(a, []), cached(a, [a]), cached(b, [a, a])] == [0, 32, 0]    # the oracle is not trivial
    # n samples share one prompt: counted once; streamed, each chunk's usage says it (the engine's first row
    # comes before any text) and so does the last
    got = completion(served, prompt=b, n=2)
    assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    chunks = post(served, "/v1/completions", {"model": MODEL, "prompt": b, "max_tokens": 3, "stream": True,
                                              "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True}})[1]
    assert [c["usage"]["prompt_tokens_details"] for c in chunks] == [{"cached_tokens": 32}] * len(chunks)


def test_chat_messages_and_responses_report_the_prompt_tokens_found_cached(served):
    content = "Zebra quartz: the quick brown fox jumps over the lazy dog, and experts route each token."
    messages = [{"role": "user", "content": content}]
    ids = chat_ids(served.tokenizer, messages)
    assert len(ids) > 2 * BLOCK
    first = post(served, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2})[1]
    again = cached(ids, [ids])
    assert again == (len(ids) - 1) // BLOCK * BLOCK > 0
    assert first["usage"]["prompt_tokens"] == len(ids)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": cached(ids, [])}
    chunks = post(served, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                   "stream": True, "stream_options": {"include_usage": True}})[1]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": again}
    # Anthropic's: the input tokens less the cached ones, which cache_read_input_tokens counts
    code, msg = post(served, "/v1/messages", {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert code == 200, msg
    assert (msg["usage"]["input_tokens"], msg["usage"]["cache_read_input_tokens"]) == (len(ids) - again, again)
    delta = [e for e in _events(served, "/v1/messages", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                          "stream": True}) if e["type"] == "message_delta"]
    assert len(delta) == 1 and delta[0]["usage"]["input_tokens"] == len(ids) - again
    assert delta[0]["usage"]["cache_read_input_tokens"] == again and delta[0]["usage"]["output_tokens"] == 2
    # the Responses API's input string is the same user message
    code, resp = post(served, "/v1/responses", {"model": MODEL, "input": content, "max_output_tokens": 2})
    assert code == 200, resp
    assert resp["usage"]["input_tokens"] == len(ids)
    assert resp["usage"]["input_tokens_details"]["cached_tokens"] == again


def _events(served, path: str, body: dict) -> list[dict]:
    """The data of each server-sent event of a streamed answer."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200, raw
    return [json.loads(line[len("data: "):]) for line in raw.split("\n") if line.startswith("data: ")]


def test_reset_prefix_cache_endpoint_forgets_the_cache(served):
    """vLLM's POST /reset_prefix_cache: a prompt cached before it is found cached no more after it."""
    a = make_prompts(1, 256, 40, 45, seed=907)[0]
    counts = []
    for reset in (False, False, True):
        if reset:       # vLLM's answer
            assert post(served, "/reset_prefix_cache", {}) == (200, {"success": True})
        counts.append(completion(served, prompt=a)["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert counts == [0, cached(a, [a]), 0] and counts[1] > 0
    code, body = post(served, "/reset_prefix_cache?reset_external=true", {})
    assert code == 400 and body["error"]["param"] == "reset_external", body
