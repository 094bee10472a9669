"""The OpenAI-compatible server (launch/serve.py under torchrun, 1 attention + 2 expert ranks) on loopback:
the real `openai` client gets what LLM.generate gives; bad requests get OpenAI-style 4xx errors; stop
strings, stop token ids and seeds work; unknown fields are ignored with one warning naming them; continuous
usage stats count the tokens streamed; the access log has one line per request; /tokenize and /detokenize
agree with the tokenizer; a client that goes away has its request aborted and its KV blocks returned; an
idle server outlives its collective timeout; a schema fuzz pass gets no 5xx; 500 requests at concurrency 32
all complete in full; SIGTERM stops every rank; a killed rank takes the server down."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import time

import openai
import pytest

from launch import LLM, SamplingParams
from launch.local_server import LocalServer
from tests.dist_utils import alive

KEY = "test-key"
MODEL = "tiny"
MAX_LEN = 128
COLLECTIVE_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint, tmp_path_factory):
    import shutil
    path = os.path.join(tmp_path_factory.mktemp("served"), MODEL)
    shutil.copytree(tiny_checkpoint("qwen3_moe"), path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    srv = LocalServer(model_dir, nproc=3, args=[
        "--attention-ranks", "1", "--api-key", KEY, "--max-model-len", str(MAX_LEN),
        "--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), "--heartbeat-s", "0.5",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--responses-store", "1"])
    with srv:
        yield srv


@pytest.fixture(scope="module")
def reference(model_dir):
    with LLM(model_dir, attention_ranks=1, expert_ranks=1, max_model_len=MAX_LEN) as llm:
        yield llm


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body, key: str | None = KEY, raw: bytes | None = None,
         content_type: str = "application/json") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    headers = {"Content-Type": content_type}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=raw if raw is not None else json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data


GREEDY = dict(temperature=0, max_tokens=8)
PROMPTS = ["Hello experts", "The quick brown fox"]


def test_health_said_loading_before_ready(server):
    assert server.health_seen[-1] == 200
    assert 503 in server.health_seen, server.health_seen


def test_listens_on_loopback_by_default(server):
    """The fixture passes no --host: the listening socket is bound to 127.0.0.1 only."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    listening = [r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == server.port]
    assert listening == [f"0100007F:{server.port:04X}"], listening
    assert f"on http://127.0.0.1:{server.port}" in server.log()


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_completions_equal_generate(client, reference):
    want = reference.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    got = client.completions.create(model=MODEL, prompt=PROMPTS, extra_body={"ignore_eos": True}, **GREEDY)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in want]
    assert all(c.finish_reason == "length" for c in got.choices)
    assert got.usage.completion_tokens == 16
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    for prompt, w in zip(PROMPTS, want):
        stream = client.completions.create(model=MODEL, prompt=prompt, stream=True, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True}, **GREEDY)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == w.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 8


def test_chat_equals_generate_on_the_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello experts"}]
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    want = reference.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, extra_body={"ignore_eos": True}, **GREEDY)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 8)
    stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.total_tokens == len(ids) + 8


def test_chat_continues_the_final_message(client, reference, server):
    """vLLM's continue_final_message: the last (assistant) message is continued, its turn left open, as
    transformers' template renders it; with add_generation_prompt (its default, true) it is a 400 naming it."""
    messages = [{"role": "user", "content": "Hello experts"}, {"role": "assistant", "content": "Well met"}]
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, continue_final_message=True, tokenize=False),
                     add_special_tokens=False)
    want = reference.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, extra_body={
        "ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}, **GREEDY)
    assert got.choices[0].message.content == want.text and got.usage.prompt_tokens == len(ids)
    code, data = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                        "continue_final_message": True})
    assert code == 400 and data["error"]["param"] == "continue_final_message", data


def test_stop_strings_and_stop_token_ids(client, reference):
    full = reference.generate(["Hello experts"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    # a stop token id: generation ends on it (its text is a special-free decode, so compare token counts)
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    got = client.completions.create(model=MODEL, prompt="Hello experts", temperature=0, max_tokens=12,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == first + 1
    assert got.choices[0].stop_reason == stop_id          # vLLM's stop_reason: the stop token id
    # as vLLM: the stop token's own text is left out (LLM.generate's too), unless include_stop_str_in_output
    shown = [reference.tokenizer.decode(full.token_ids[:n], skip_special_tokens=True) for n in (first, first + 1)]
    assert shown[0] != shown[1]
    kept = client.completions.create(model=MODEL, prompt="Hello experts", temperature=0, max_tokens=12, extra_body={
        "ignore_eos": True, "stop_token_ids": [stop_id], "include_stop_str_in_output": True}).choices[0].text
    assert (got.choices[0].text, kept) == (shown[0], shown[1])
    alone = reference.generate(["Hello experts"], SamplingParams(max_tokens=12, ignore_eos=True,
                                                                 stop_token_ids=[stop_id]))[0]
    assert alone.text == shown[0] and alone.token_ids == full.token_ids[:first + 1]
    # a stop string: the text ends right before its first occurrence
    text = full.text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2]
                and text.find(text[i:i + 2]) == i)
    for stream in (False, True):
        out, reason = _stopped_completion(client, 12, [stop, "never-appears"], stream)
        assert out == text[:text.index(stop)] and reason == "stop", (stream, out, stop, text)
        # stop_reason names the stop string; include_stop_str_in_output (vLLM's) keeps it in the text
        for keep in (False, True):
            res = client.completions.create(model=MODEL, prompt="Hello experts", temperature=0, max_tokens=12,
                                            stop=[stop], stream=stream,
                                            extra_body={"ignore_eos": True, "include_stop_str_in_output": keep})
            chunks = list(res) if stream else [res]
            out = "".join(c.choices[0].text for c in chunks)
            assert out == text[:text.index(stop) + (len(stop) if keep else 0)], (stream, keep, out, stop, text)
            assert [c.choices[0].stop_reason for c in chunks][-1] == stop, (stream, keep)
    assert client.completions.create(model=MODEL, prompt="Hello experts", temperature=0, max_tokens=3,
                                     extra_body={"ignore_eos": True}).choices[0].stop_reason is None   # length
    # a stop string whose first occurrence ends the n-th token: the engine finishes the request (length) in the
    # same step as the front finds the stop, which names the reason (as vLLM does); it is not seen whole before
    # the n-th token (not in what the first n - 1 tokens show)
    shown = [reference.tokenizer.decode(full.token_ids[:n], skip_special_tokens=True) for n in range(13)]
    n, last = next((n, shown[n][-k:]) for n in range(12, 2, -1) for k in range(1, 9)
                   if "\ufffd" not in shown[n][-k:] and shown[n].find(shown[n][-k:]) == len(shown[n]) - k
                   and shown[n][-k:] not in shown[n - 1].rstrip("\ufffd"))
    for stream in (False, True):
        out, reason = _stopped_completion(client, n, [last], stream)
        assert out == shown[n][:-len(last)] and reason == "stop", (stream, out, last, shown[n])


def test_stop_strings_are_looked_for_only_past_min_tokens(client, reference):
    """As vLLM: with min_tokens m, a stop string the first m tokens show does not end the request; the text ends
    before its first occurrence in what the later tokens add."""
    full = reference.generate(["Hello experts"], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    shown = [reference.tokenizer.decode(full.token_ids[:n], skip_special_tokens=True) for n in range(25)]
    text = shown[24]
    found = [(m, ch) for m in range(3, 12) if "\ufffd" not in shown[m] for ch in shown[m][:len(shown[m]) // 2]
             if ch.strip() and ch != "\ufffd" and ch in text[len(shown[m]):].rstrip("\ufffd")]
    assert found, f"no character of the early text comes back later: {text!r}"
    m, stop = found[0]
    for stream in (False, True):
        res = client.completions.create(model=MODEL, prompt="Hello experts", temperature=0, max_tokens=24,
                                        stop=[stop], stream=stream, extra_body={"ignore_eos": True, "min_tokens": m})
        chunks = [res] if not stream else list(res)
        out = "".join(c.choices[0].text for c in chunks)
        assert out == text[:text.index(stop, len(shown[m]))], (stream, m, stop, out, text)
        assert chunks[-1].choices[0].finish_reason == "stop"
    # without min_tokens the first occurrence, within the first m tokens' text, ends it
    assert _stopped_completion(client, 24, [stop], False) == (text[:text.index(stop)], "stop")


def _stopped_completion(client, max_tokens: int, stop: list[str], stream: bool) -> tuple[str, str]:
    """"Hello experts" greedily to max_tokens with these stop strings, streamed or not: (text, finish_reason)."""
    res = client.completions.create(model=MODEL, prompt="Hello experts", temperature=0, max_tokens=max_tokens,
                                    stop=stop, stream=stream, extra_body={"ignore_eos": True})
    if not stream:
        return res.choices[0].text, res.choices[0].finish_reason
    chunks = list(res)
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def test_vllm_sampling_and_text_options(server, reference):
    """vLLM's request extensions: min_p 1 makes a draw greedy; allowed_token_ids and bad_words equal
    LLM.generate with the same engine
    parameters (bad_words as vLLM tokenizes a word: alone, and after a space when that is another sequence of the
    same length); skip_special_tokens false shows the special tokens generated; truncate_prompt_tokens keeps the
    prompt's last k tokens (-1: max_model_len; 0 or more than max_model_len: a 400) and echo shows those; a stop
    token that is EOS has stop_reason null unless ignore_eos; none is logged as ignored."""
    tok = reference.tokenizer
    start = len(server.log())

    def complete(prompt, **extra) -> dict:
        code, data = post(server, "/v1/completions", {"prompt": prompt, "ignore_eos": True, **GREEDY, **extra})
        assert code == 200, data
        return data

    def generate(prompt, **params):
        return reference.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, **params))[0]

    prompt = "Hello experts"
    free = generate(prompt)
    allowed = sorted(set(range(3, 300, 7)) - {free.token_ids[0]})
    want = generate(prompt, allowed_token_ids=allowed)
    assert complete(prompt, allowed_token_ids=allowed)["choices"][0]["text"] == want.text != free.text
    # min_p 1 keeps only the most likely token: a draw at temperature 1 is greedy
    assert complete(prompt, temperature=1.0, seed=3, min_p=1.0)["choices"][0]["text"] == free.text

    def vllm_ids(word: str) -> list[list[int]]:   # vLLM's SamplingParams.update_from_tokenizer, as it reads
        alone, spaced = tok.encode(word.lstrip()), tok.encode(" " + word.lstrip())
        return [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])

    def bites(words: list[list[int]]) -> bool:    # the greedy output has one of them
        out = free.token_ids
        return any(w == out[i:i + len(w)] for w in words for i in range(len(out)))

    # a word of the greedy output (two tokens if one bites, else one) that the rule bans: the output changes
    word = next(w for n in (2, 1) for i in range(len(free.token_ids) - n + 1)
                if (w := tok.decode(free.token_ids[i:i + n])).strip() and "\ufffd" not in w and bites(vllm_ids(w)))
    want = generate(prompt, bad_words_token_ids=vllm_ids(word))
    assert complete(prompt, bad_words=[word])["choices"][0]["text"] == want.text != free.text, word
    # special tokens: EOS forced twice is in the text only with skip_special_tokens false
    eos = tok.eos_token_id
    forced = {"logit_bias": {str(eos): 100}, "max_tokens": 2}
    assert complete(prompt, **forced)["choices"][0]["text"] == ""
    assert complete(prompt, **forced, skip_special_tokens=False)["choices"][0]["text"] == tok.eos_token * 2
    # an EOS that ends the request is not in the text, special tokens or not, unless include_stop_str_in_output
    for extra, text in (({}, ""), ({"include_stop_str_in_output": True}, tok.eos_token)):
        choice = complete(prompt, **forced, ignore_eos=False, skip_special_tokens=False, **extra)["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (text, "stop"), (extra, choice)
    # a stop token id that is EOS: stop_reason null, as vLLM (unless ignore_eos: then it is only a stop token)
    for ignore_eos, reason in ((False, None), (True, eos)):
        choice = complete(prompt, **forced, stop_token_ids=[eos], ignore_eos=ignore_eos)["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", reason), choice
    # truncate_prompt_tokens: the last k tokens are the prompt, and echo shows them
    ids = list(range(5, 45))
    for sent, k, kept in ((ids, 10, ids[-10:]), (ids, -1, ids), ("Hello experts, the quick brown fox", 3, None)):
        kept = kept or tok.encode(sent)[-k:]
        data = complete(sent, truncate_prompt_tokens=k, echo=True)
        assert data["usage"]["prompt_tokens"] == len(kept), (k, data["usage"])
        shown = tok.decode(kept, skip_special_tokens=False)
        assert data["choices"][0]["text"] == shown + generate(kept).text, (k, data)
    for k in (0, MAX_LEN + 1):
        code, data = post(server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": k})
        assert code == 400 and data["error"]["param"] == "truncate_prompt_tokens", data
    code, data = post(server, "/v1/completions", {"prompt": ids, "allowed_token_ids": [5, 999999]})
    assert code == 400 and data["error"]["param"] == "allowed_token_ids" and "999999" in data["error"]["message"]
    assert not log_lines(server, start, "were present in the request but ignored", timeout_s=0)


def test_model_may_be_left_out_and_a_seed_may_be_negative(server):
    """As vLLM: a body without "model" (or with null) is served by the served model; a seed is any int64."""
    body = {"prompt": "Hello experts", "max_tokens": 6, "temperature": 1.0, "seed": -5, "ignore_eos": True}
    texts = []
    for model in ({}, {"model": None}, {"model": MODEL}):
        code, data = post(server, "/v1/completions", {**body, **model})
        assert code == 200, data
        texts.append(data["choices"][0]["text"])
    assert texts[0] == texts[1] == texts[2] and data["model"] == MODEL


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Hello", temperature=1.0, top_p=0.9, max_tokens=12,
                                         seed=seed, extra_body={"ignore_eos": True, "top_k": 50}).choices[0].text
    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c


JSON, FORM = "application/json", "application/x-www-form-urlencoded"


@pytest.mark.parametrize("body, raw, status, words, content_type", [
    (None, b'{"model": "tiny", "prompt": ', 400, "not valid JSON", JSON),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, None, 400, "max_tokens", JSON),
    ({"model": MODEL, "prompt": 42}, None, 400, "prompt", JSON),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, None, 400, "temperature", JSON),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, None, 400, "max_tokens", JSON),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, None, 400, "max_model_len", JSON),
    ({"model": MODEL, "prompt": list(range(3, 3 + MAX_LEN + 5))}, None, 400, "max_model_len", JSON),
    ({"model": "gpt-nothing", "prompt": "hi"}, None, 404, "gpt-nothing", JSON),
    ({"model": MODEL, "prompt": "hi", "n": 65}, None, 400, "n=65", JSON),
    ({"model": MODEL, "prompt": [], "max_tokens": 2}, None, 400, "empty", JSON),
    ({"model": MODEL, "prompt": [999999]}, None, 400, "vocabulary", JSON),
    ({"model": MODEL, "prompt": "hi", "stop": [""]}, None, 400, "stop", JSON),
    # a prompt that fills the context, with max_tokens null: the prompt is named, not a max_tokens never sent
    ({"model": MODEL, "prompt": list(range(3, 3 + MAX_LEN)), "max_tokens": None}, None, 400,
     "prompt has 128 tokens", JSON),
    # JSON sent as a form (curl -d without a JSON content type): a 400 naming the body, not a 500
    (None, b'{"model": "tiny", "prompt": "hi"}', 400, "body: Input should be", FORM),
])
def test_bad_completion_requests_get_openai_errors(server, body, raw, status, words, content_type):
    code, data = post(server, "/v1/completions", body, raw=raw, content_type=content_type)
    assert code == status, data
    err = data["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error", err


def test_tools_reach_the_template_and_serve_py_turns_auto_tool_choice_on(client, reference):
    """serve.py's --enable-auto-tool-choice and --tool-call-parser reach the front: a chat with tools (tool_choice
    "auto" by default, a 400 without the flags) answers the greedy text of the template rendered with them, special
    tokens kept, and no calls (the tiny model writes none; tests/launch/frontend/test_http_tools.py has the rest)."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    msgs = [{"role": "user", "content": "hi"}]
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    out = reference.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    got = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, temperature=0, max_tokens=4,
                                         extra_body={"ignore_eos": True})
    c = got.choices[0]
    assert c.message.content == tok.decode(out.token_ids, skip_special_tokens=False) and not c.message.tool_calls
    assert got.usage.prompt_tokens == len(ids) and c.finish_reason == "length"


def test_serve_py_bounds_the_stored_responses(client):
    """--responses-store 1 reaches the front: the openai SDK reads a stored response back until a newer one
    pushes it out."""
    first = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0)
    assert first.store and client.responses.retrieve(first.id).id == first.id
    second = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0)
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.retrieve(first.id)


def test_anthropics_clients_key_is_taken_as_a_bearer_token_or_x_api_key(server, reference):
    """The anthropic SDK (2.x sends its api_key as a bearer token) gets the greedy text of the chat template; the
    x-api-key header that Anthropic's other clients send is taken as the bearer token is; a wrong key is a 401."""
    anthropic = pytest.importorskip("anthropic")
    tok = reference.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    out = reference.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    got = client.messages.create(model=MODEL, max_tokens=4, messages=msgs,
                                 extra_body={"temperature": 0, "ignore_eos": True})
    assert got.content[0].text == tok.decode(out.token_ids) and got.stop_reason == "max_tokens"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=msgs)
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": msgs, "temperature": 0, "ignore_eos": True})
    for key, status in ((KEY, 200), ("wrong", 401)):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/v1/messages", body=body,
                     headers={"Content-Type": "application/json", "x-api-key": key})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        conn.close()
        assert resp.status == status, data
        assert status == 401 or data["content"][0]["text"] == got.content[0].text


def test_auto_tool_choice_needs_a_parser_and_a_reasoning_parser_its_tokens(model_dir):
    import subprocess
    import sys
    from launch.local_server import ROOT

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "launch/serve.py", *args], capture_output=True, cwd=ROOT, text=True,
                              env={**os.environ, "WORLD_SIZE": "1"}, timeout=120)
    run = serve("--enable-auto-tool-choice")
    want = "--enable-auto-tool-choice needs --tool-call-parser (one of deepseek_v3, glm45, hermes, mistral, openai)"
    assert run.returncode == 2 and want in run.stderr, run.stderr
    run = serve("--model", model_dir, "--reasoning-parser", "deepseek_r1")    # the tiny tokenizer has no <think>
    assert run.returncode == 2 and "needs the tokens <think> and </think>" in run.stderr, run.stderr
    run = serve("--model", model_dir, "--reasoning-parser", "openai_gptoss")       # nor GPT-OSS's markers
    assert run.returncode == 2 and "lacks <|start|>, <|channel|>" in run.stderr, run.stderr
    run = serve("--tool-call-parser", "openai", "--reasoning-parser", "qwen3")
    assert run.returncode == 2 and "take each other or none" in run.stderr, run.stderr
    run = serve("--responses-store", "-1")
    assert run.returncode == 2 and "--responses-store -1 is invalid" in run.stderr, run.stderr
    run = serve("--api-key", "")        # an empty key would match a missing x-api-key header: refused
    assert run.returncode == 2 and "--api-key is empty" in run.stderr, run.stderr
    from launch.frontend.api_server import build_app
    with pytest.raises(ValueError, match="api_key is empty"):
        build_app(MODEL, model_dir, api_key="")


def test_bad_chat_requests_get_openai_errors(server):
    code, data = post(server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert code == 400 and "messages" in data["error"]["message"]
    code, data = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": 1}]})
    assert code == 400 and "messages" in data["error"]["param"]
    code, data = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert code == 400 and "text parts only" in data["error"]["message"]
    code, data = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": MAX_LEN,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and data["error"]["code"] == "context_length_exceeded"


def test_completion_max_tokens_null_is_all_that_fits_each_prompt(server):
    """vLLM reads a completion's "max_tokens": null as the room its prompt leaves in max_model_len (each prompt
    of a batch its own); left out, it is OpenAI's 16."""
    prompts = [list(range(5, 105)), list(range(5, 115))]
    for sent, want in (({"max_tokens": None}, [MAX_LEN - 100, MAX_LEN - 110]), ({}, [16, 16])):
        code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "temperature": 0,
                                                      "ignore_eos": True, **sent})
        assert code == 200, data
        assert [c["finish_reason"] for c in data["choices"]] == ["length", "length"]
        assert data["usage"]["completion_tokens"] == sum(want), (sent, data["usage"])


def test_api_key_is_required(server):
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi"}), ("/tokenize", {"prompt": "hi"}),
                       ("/detokenize", {"tokens": [5]})):
        for key in (None, "wrong"):
            code, data = post(server, path, body, key=key)
            assert code == 401 and data["error"]["code"] == "invalid_api_key", (path, key)
    assert server.health() == 200     # /health and /metrics stay open for probes and scrapers


def log_lines(server, start: int, pattern: str, timeout_s: float = 10.0) -> list[str]:
    """Lines of the server's log after offset `start` that match `pattern`, waiting up to timeout_s for one
    (the access line of a request is written after its response has gone out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in server.log()[start:].splitlines() if re.search(pattern, line)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_unknown_fields_are_ignored_with_one_warning(server, client):
    start = len(server.log())
    ignored = "The following fields were present in the request but ignored"
    got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, stream=True,
                                    stream_options={"include_usage": True, "zz_depth": 1},
                                    extra_body={"ignore_eos": True, "zz_top": {"a": [1]}, "zz_penalty": 1.1})
    assert [c for c in got][-1].usage.completion_tokens == 3
    chat = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": "Hello", "zz_msg": True}], extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 2
    lines = log_lines(server, start, ignored)
    assert len(lines) == 2, lines          # one line per request, naming every ignored field at any depth
    assert "'stream_options.zz_depth', 'zz_penalty', 'zz_top'" in lines[0], lines[0]
    assert "'messages.0.zz_msg'" in lines[1] and "/v1/chat/completions" in lines[1], lines[1]
    # fields this server knows but does not implement are still refused, named
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "!", "zz_other": 1})
    assert code == 400 and data["error"]["param"] == "suffix", data


def test_continuous_usage_stats_count_the_tokens_streamed(client, reference):
    prompt, n = "Hello experts", 12       # its greedy text has whole characters between partial ones
    want = reference.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    num_prompt = len(want.prompt_token_ids)
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    text, counts = "", []
    for c in chunks[:-1]:
        text += c.choices[0].text
        u = c.usage
        assert (u.prompt_tokens, u.total_tokens) == (num_prompt, num_prompt + u.completion_tokens), u
        counts.append(u.completion_tokens)
        # the text sent so far is the decoded tokens counted so far (until the end, less trailing partial
        # UTF-8 sequences, which decode as U+FFFD)
        so_far = reference.decode(want.token_ids[:u.completion_tokens])
        assert text == (so_far if c.choices[0].finish_reason else so_far.rstrip("\ufffd")), (text, u)
    assert counts == sorted(counts) and counts[-1] == n and len(counts) >= 3, counts
    assert text == want.text
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == n     # the include_usage chunk
    messages = [{"role": "user", "content": "Hello experts"}]
    num_chat_prompt = len(reference.tokenizer.encode(reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    usages = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks]
    assert usages[0] == (num_chat_prompt, 0) and usages[-1] == (num_chat_prompt, 3), usages
    # continuous_usage_stats alone: no usage at all (as vLLM, which counts it only with include_usage)
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True,
        stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert len(chunks) >= 2 and all(c.usage is None for c in chunks), chunks


def test_access_log_has_status_tokens_latency_and_errors(server, client):
    prompt = [11, 12, 13, 14, 15, 16, 17]      # 7 prompt tokens, 5 generated
    start = len(server.log())
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    pat = r'"POST /v1/completions" 200 prompt_tokens=7 completion_tokens=5 latency_ms=(\d+\.\d)$'
    assert len(log_lines(server, start, pat)) == 1, server.log()[start:]
    start = len(server.log())
    t0 = time.monotonic()
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert len("".join(c.choices[0].text for c in stream)) > 0
    took_ms = (time.monotonic() - t0) * 1e3
    lines = log_lines(server, start, pat)
    assert len(lines) == 1, server.log()[start:]         # written once, when the stream ended
    assert 0 < float(re.search(pat, lines[0]).group(1)) <= took_ms + 50, (lines, took_ms)
    start = len(server.log())
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3})
    assert code == 400
    lines = log_lines(server, start, r'"POST /v1/completions" 400 prompt_tokens=- completion_tokens=- ')
    assert len(lines) == 1 and lines[0].endswith(f" error={json.dumps(data['error']['message'])}"), lines
    code, _ = post(server, "/detokenize", {"tokens": [5]})
    assert code == 200
    assert log_lines(server, start, r'"POST /detokenize" 200 prompt_tokens=- completion_tokens=- latency_ms=')


def test_tokenize_and_detokenize_agree_with_the_tokenizer(server, model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "Hello experts: ünïcödé, 123 and <s> too"
    for special in (True, False):
        code, data = post(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": special})
        want = tok.encode(text, add_special_tokens=special)
        assert code == 200 and data == {"count": len(want), "max_model_len": MAX_LEN, "tokens": want}, data
    code, data = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert data["token_strs"] == tok.convert_ids_to_tokens(tok.encode(text)), data
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello experts"}]
    for gen in (True, False):
        code, data = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": gen})
        want = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False),
                          add_special_tokens=False)
        assert code == 200 and data["tokens"] == want and data["count"] == len(want), (gen, data)
    partial = messages + [{"role": "assistant", "content": "Hel"}]
    code, data = post(server, "/tokenize", {"messages": partial, "add_generation_prompt": False,
                                            "continue_final_message": True})
    want = tok.encode(tok.apply_chat_template(partial, continue_final_message=True, tokenize=False),
                      add_special_tokens=False)
    assert code == 200 and data["tokens"] == want, data
    ids = tok.encode(text) + [tok.eos_token_id]
    code, data = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert code == 200 and data == {"prompt": tok.decode(ids, skip_special_tokens=False)}, data
    for path, body, status, words in [
        ("/detokenize", {"tokens": [5, 999999]}, 400, "999999"),
        ("/detokenize", {"tokens": [5, -1]}, 400, "tokens.1"),
        ("/detokenize", {"model": "gpt-nothing", "tokens": [5]}, 404, "gpt-nothing"),
        ("/tokenize", {"model": "gpt-nothing", "prompt": "hi"}, 404, "gpt-nothing"),
        ("/tokenize", {"prompt": "hi", "messages": messages}, 400, "exactly one"),
        ("/tokenize", {"add_special_tokens": True}, 400, "exactly one"),
        ("/tokenize", {"messages": messages, "continue_final_message": True}, 400, "add_generation_prompt"),
        ("/tokenize", {"prompt": "hi", "chat_template_kwargs": {"x": 1}}, 400, "pass messages instead of prompt"),
        ("/tokenize", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ("/tokenize", {"prompt": "hi", "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ]:
        code, data = post(server, path, body)
        assert code == status and words in data["error"]["message"], (path, body, data)


def _kv_used_and_aborted(server) -> tuple[int, int]:
    """KV blocks in use over all ranks and requests finished by abort, from one /metrics scrape."""
    text = server.metrics()
    used = sum(int(float(v)) for v in re.findall(r'^afserve_kv_blocks_used\{rank="\d+"\} (\S+)$', text, re.M))
    m = re.search(r'^afserve_requests_finished_total\{finish_reason="abort"\} (\S+)$', text, re.M)
    return used, int(float(m.group(1))) if m else 0


def test_client_disconnect_aborts_and_frees_kv_blocks(server):
    before_used, before_aborted = _kv_used_and_aborted(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "prompt": "Hello experts " * 8, "max_tokens": 90, "temperature": 0, "stream": True,
            "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read(6) == b"data: "                      # generation has started: it holds KV blocks
    conn.sock.close()                                      # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 20
    used, aborted = _kv_used_and_aborted(server)
    while (aborted <= before_aborted or used != before_used) and time.monotonic() < deadline:
        time.sleep(0.2)
        used, aborted = _kv_used_and_aborted(server)
    assert aborted == before_aborted + 1
    assert used == before_used
    text = server.metrics()
    assert re.search(r'^afserve_requests_running 0\.0$', text, re.M)


def test_metrics_cover_latency_tokens_and_per_layer_comm(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    text = server.metrics()
    for name in ("afserve_time_to_first_token_seconds_bucket", "afserve_time_per_output_token_seconds_count",
                 "afserve_e2e_request_latency_seconds_sum", "afserve_generation_tokens_total",
                 "afserve_requests_waiting", 'afserve_kv_blocks_total{rank="0"}', "afserve_expert_load_max_mean"):
        assert name in text, name
    for role, rank in (("attention", 0), ("expert", 1), ("expert", 2)):
        for layer in (0, 1):
            for phase in ("dispatch", "combine"):
                pat = (rf'^afserve_layer_comm_seconds_total\{{layer="{layer}",phase="{phase}",rank="{rank}",'
                       rf'role="{role}"\}} (\S+)$')
                m = re.search(pat, text, re.M)
                assert m and float(m.group(1)) > 0, pat
    # micro_batches auto: 3 ranks ping-pong only with a core each
    cores = len(os.sched_getaffinity(0))
    assert re.search(rf'^afserve_micro_batches {2 if cores >= 3 else 1}\.0$', text, re.M), cores


def test_idle_server_outlives_the_collective_timeout(server, client):
    time.sleep(COLLECTIVE_TIMEOUT_S + 2)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_schema_fuzz_gets_no_5xx(server):
    """Positive (schema-valid) and negative (schema-violating) cases for every operation."""
    import collections

    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures, seen = [], collections.Counter()

    def checker(positive: bool):
        @settings(max_examples=40, deadline=None, database=None, phases=[Phase.generate], derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            if positive and isinstance(case.body, dict):
                case.body["model"] = MODEL          # a random model name only ever gets the 404
            response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            seen[response.status_code // 100] += 1
            if response.status_code >= 500:
                failures.append((case.operation.label, case.body, response.status_code, response.text[:300]))
        return check

    for result in schema.get_all_operations():
        op = result.ok()
        given(case=op.as_strategy(schemathesis.GenerationMode.POSITIVE))(checker(True))()
        # GETs (their path parameters are any string) and a POST without parameters or a body (/ping) have no
        # schema to violate
        if op.method.upper() == "POST" and (list(op.iter_parameters()) or op.get_request_payload_content_types()):
            given(case=op.as_strategy(schemathesis.GenerationMode.NEGATIVE))(checker(False))()
    assert not failures, failures[:3]
    print("fuzz statuses by class:", dict(seen))
    assert seen[2] >= 10 and seen[4] >= 20, seen      # both served requests and refusals were exercised
    assert server.health() == 200


def test_load_500_requests_at_concurrency_32_all_complete(server):
    rng = __import__("random").Random(0)
    wanted = [rng.randint(2, 12) for _ in range(500)]
    words = ["experts", "tokens", "layer", "rank", "hello", "world"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in wanted]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        sem = asyncio.Semaphore(32)

        async def one(prompt, n, stream):
            async with sem:
                if stream:
                    res = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0.8,
                                                           stream=True, stream_options={"include_usage": True},
                                                           extra_body={"ignore_eos": True})
                    chunks = [c async for c in res]
                    return chunks[-1].usage.completion_tokens, [c for c in chunks if c.choices][-1].choices[0]
                res = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0.8,
                                                       extra_body={"ignore_eos": True})
                return res.usage.completion_tokens, res.choices[0]

        try:
            return await asyncio.gather(*(one(p, n, i % 2 == 0) for i, (p, n) in enumerate(zip(prompts, wanted))))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert [n for n, _ in results] == wanted
    assert all(choice.finish_reason == "length" for _, choice in results)


def test_sigterm_shuts_down_every_rank(model_dir):
    with LocalServer(model_dir, nproc=3, args=["--attention-ranks", "1"]) as srv:
        pids = srv.rank_pids
        assert sorted(pids) == [0, 1, 2]
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.wait(30) is not None
        log = srv.log()
    assert "shut down cleanly" in log and "failed" not in log, log[-3000:]
    for pid in pids.values():
        assert not alive(pid), f"rank pid {pid} outlived the shutdown"


def test_killed_rank_takes_the_server_down(model_dir):
    with LocalServer(model_dir, nproc=3, args=["--attention-ranks", "1"]) as srv:
        pids = srv.rank_pids
        t0 = time.monotonic()
        __import__("os").kill(pids[2], signal.SIGKILL)
        code = srv.wait(30)
        took = time.monotonic() - t0
    assert code not in (None, 0), code
    assert took < 15, took
    for pid in pids.values():
        assert not alive(pid)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_the_http_front_is_a_process_of_its_own(model_dir):
    """The front answers from its own process, a child of the leader (rank 0); a clean shutdown ends it too."""
    with LocalServer(model_dir, nproc=2, args=["--attention-ranks", "1"]) as srv:
        pids, front = srv.rank_pids, srv.front_pid
        assert front is not None and front not in pids.values()
        assert _parent(front) == pids[0]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.wait(30) is not None
        log = srv.log()
    assert "shut down cleanly" in log and "HTTP front exited" not in log, log[-3000:]
    assert not alive(front)


def test_a_killed_front_takes_the_server_down(model_dir):
    """The job never serves without its front: SIGKILL on the front ends every rank, non-zero, within seconds."""
    with LocalServer(model_dir, nproc=2, args=["--attention-ranks", "1"]) as srv:
        pids, front = srv.rank_pids, srv.front_pid
        t0 = time.monotonic()
        __import__("os").kill(front, signal.SIGKILL)
        code = srv.wait(30)
        took = time.monotonic() - t0
        log = srv.log()
    assert code not in (None, 0), code
    assert took < 15, took
    assert "the HTTP front exited" in log, log[-2000:]
    for pid in pids.values():
        assert not alive(pid)


def test_a_leader_that_fails_to_start_does_not_wait_for_its_front(model_dir):
    """One rank, so the engine refuses to start (no expert rank) after the front is already listening: the
    leader must end its front and exit, not wait on it forever (its front ignores SIGTERM)."""
    srv = LocalServer(model_dir, nproc=1, args=["--attention-ranks", "1"], startup_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with status [1-9]") as err:
        srv.start()
    assert time.monotonic() - t0 < 45
    assert "expert" in str(err.value), str(err.value)[-2000:]
