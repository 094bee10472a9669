"""The HTTP front's logprobs, echo, penalties, logit_bias and prefix-cache metrics, on an in-process server (the
app of launch/frontend/api_server.py on uvicorn in a thread, attached to one `LLM` on 1+1 spawned ranks).

Oracles: transformers' own fp32 logits for every logprob and top-k set; `LLM.generate` on the same engine
(before the front attaches) for what penalties and logit_bias do; the scheduler's block arithmetic for the
prefix-cache counters; the returned text itself for text offsets."""
from __future__ import annotations

import contextlib
import http.client
import json
import re
import time
from dataclasses import dataclass

import pytest
import torch

from launch import LLM, SamplingParams
from tests.conftest import hf_model, make_prompts
from tests.launch.frontend.in_process import serving

MODEL = "tiny"
MAX_LEN = 128
MAX_SEQS = 8                     # a request's samples run side by side: n or best_of above this is a 400
GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class Served:
    port: int
    path: str
    tokenizer: object
    plain: list[int]             # greedy tokens of PROMPT (8 of them), from LLM.generate
    expected: dict               # case name -> (request fields, LLM.generate's output)
    chat_expected: tuple         # (plain, logit_bias case) outputs of LLM.generate on CHAT's template ids
    chat_sampled: object         # LLM.generate's output for CHAT at temperature 1, seed SEED
    samples: list                # LLM.generate's outputs for [PROMPT, OTHER] with SAMPLED (n=2)
    best: object                 # LLM.generate's output for PROMPT with RANKED, n=2, best_of=3
    client: object               # the app's EngineClient
    structured: dict = None      # STRUCTURED case -> LLM.generate's output for PROMPT under it (greedy)


PROMPT = make_prompts(1, 256, 12, 12, seed=21)[0]
OTHER = make_prompts(1, 256, 9, 9, seed=22)[0]
CHAT = [{"role": "user", "content": "Hello"}]
SEED = 3
SAMPLED = {"max_tokens": 6, "temperature": 1.0, "seed": SEED, "ignore_eos": True}   # request and SamplingParams
RANKED = {**SAMPLED, "seed": 4}    # a seed whose best 2 of 3 samples are not samples 0 and 1
YES_NO = {"enum": ["yes", "no"]}
STRUCTURED = {"regex": {"regex": r"[0-9]{3}-[a-z]{2}"}, "json": {"json": YES_NO}, "json_object": {"json_object": True},
              "choice": {"choice": ["red", "green", "blue"]}}


def chat_ids(tok, messages) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def _penalty_cases(plain: list[int]) -> dict[str, tuple[dict, dict]]:
    """name -> (request fields, the same as SamplingParams fields). Each one changes the greedy output."""
    first = plain[0]
    return {
        "presence": ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
        "frequency": ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
        "repetition": ({"repetition_penalty": 3.0}, {"repetition_penalty": 3.0}),
        "logit_bias": ({"logit_bias": {str(first): -100, "65": 6.5}}, {"logit_bias": {first: -100.0, 65: 6.5}}),
        "min_tokens": ({"min_tokens": 4, "stop_token_ids": [first]}, {"min_tokens": 4, "stop_token_ids": [first]}),
    }


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    with LLM(path, attention_ranks=1, expert_ranks=1, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS) as llm:
        # The Python API's answers first: once the front attaches, its router thread owns the outbox.
        plain = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        cases = _penalty_cases(plain)
        outs = llm.generate([PROMPT] * len(cases), [SamplingParams(max_tokens=8, ignore_eos=True, **kw)
                                                     for _, kw in cases.values()])
        expected = {name: (fields, out) for (name, (fields, _)), out in zip(cases.items(), outs)}
        ids = chat_ids(llm.tokenizer, CHAT)
        chat_plain = llm.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        chat_biased = llm.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={
            chat_plain.token_ids[0]: -100.0, 65: 6.5}))[0]
        chat_sampled = llm.generate([ids], SamplingParams(max_tokens=5, temperature=1.0, seed=SEED,
                                                          ignore_eos=True))[0]
        samples = llm.generate([PROMPT, OTHER], SamplingParams(n=2, **SAMPLED))
        best = llm.generate([PROMPT], SamplingParams(n=2, best_of=3, **RANKED))[0]
        structured = dict(zip(STRUCTURED, llm.generate([PROMPT] * len(STRUCTURED), [
            SamplingParams(max_tokens=12, structured_outputs=spec) for spec in STRUCTURED.values()])))
        with serving(llm, path, MODEL) as (port, client):
            yield Served(port, path, llm.tokenizer, plain, expected, (chat_plain, chat_biased), chat_sampled,
                         samples, best, client, structured)


def post(served: Served, path: str, body: dict) -> tuple[int, dict | list[dict]]:
    """(status, JSON body), or for a stream (status, [every data chunk before [DONE]])."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    if not body.get("stream") or resp.status != 200:
        return resp.status, json.loads(raw)
    events = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", raw[-300:]
    return resp.status, [json.loads(e) for e in events[:-1]]


def complete(served: Served, **fields) -> dict:
    code, data = post(served, "/v1/completions", {"model": MODEL, **fields})
    assert code == 200, data
    return data


@pytest.fixture(scope="module")
def hf(served):
    return hf_model(served.path)


def hf_logprobs(model, seq: list[int]) -> torch.Tensor:
    """[len(seq) - 1, V]: row p is transformers' log-distribution of token p + 1 given seq[:p + 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def legacy_top(name, token: int, row: torch.Tensor, k: int) -> dict[str, float]:
    """What completions' top_logprobs must hold at a position: the token and transformers' top k, by their own
    decode; two ids with one string keep the token's, then the likelier one's value."""
    out: dict[str, float] = {name(token): row[token].item()}
    for t in row.topk(k).indices.tolist():
        out.setdefault(name(t), row[t].item())
    return out


def assert_close_dicts(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want), (got, want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-4), (key, got, want)


def check_offsets(tok, text: str, ids: list[int], tokens: list[str], offsets: list[int], start: int) -> None:
    """Token i starts where the decode of tokens 0..i-1 ends (a character they hold only part of counts as
    theirs: it decodes as one U+FFFD), after `start`; each token whose own decode is whole characters is
    found in the text there."""
    assert offsets == [start + len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
    assert offsets[-1] <= len(text)
    for name, at in zip(tokens, offsets):
        if "\ufffd" not in name:
            assert text[at:at + len(name)] == name, (name, at, text)


def test_echo_with_max_tokens_0_scores_the_prompt(served, hf):
    tok = served.tokenizer
    prompt = "Hello experts, the quick brown fox"
    ids = tok.encode(prompt)
    name = lambda t: tok.decode([t])  # noqa: E731
    got = complete(served, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    choice = got["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert lp["tokens"] == [name(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = hf_logprobs(hf, ids)
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(want[p - 1, ids[p]].item(), abs=1e-4), p
        assert_close_dicts(lp["top_logprobs"][p], legacy_top(name, ids[p], want[p - 1], 3))
    check_offsets(tok, prompt, ids, lp["tokens"], lp["text_offset"], 0)
    # echo without logprobs, and with them on token ids: the text is the ids' decode
    assert complete(served, prompt=prompt, echo=True, max_tokens=0)["choices"][0]["logprobs"] is None
    got = complete(served, prompt=ids, echo=True, logprobs=0, max_tokens=0)["choices"][0]
    assert got["text"] == prompt and got["logprobs"]["tokens"] == lp["tokens"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-6)
    # characters split over tokens (the tiny tokenizer knows ASCII only): offsets still follow the text
    split = "Grüße, ünïcödé ✓ experts"
    split_ids = tok.encode(split)
    got = complete(served, prompt=split, echo=True, logprobs=1, max_tokens=0)["choices"][0]
    assert got["text"] == split and any("\ufffd" in t for t in got["logprobs"]["tokens"])
    want = hf_logprobs(hf, split_ids)
    assert got["logprobs"]["token_logprobs"][1:] == pytest.approx([want[p - 1, split_ids[p]].item()
                                                                   for p in range(1, len(split_ids))], abs=1e-4)
    check_offsets(tok, split, split_ids, got["logprobs"]["tokens"], got["logprobs"]["text_offset"], 0)


def _rank_bounds(row: torch.Tensor, tok: int, tol: float = 1e-4) -> tuple[int, int]:
    """The ranks (1 = most likely) token tok may have, given transformers' log-distribution row: counting the
    tokens surely more likely, and those at least as likely within tol."""
    x = row[tok].item()
    return int((row > x + tol).sum()) + 1, int((row >= x - tol).sum())


def check_prompt_logprobs(got: list, ids: list[int], want: torch.Tensor, k: int, name) -> None:
    """vLLM's prompt_logprobs over ids against transformers' rows: None first, then the prompt token (its rank in
    the vocabulary) and the top k (ranks 1..k), keyed by id as a string, each with its own decode."""
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        tok, row, entry = ids[p], want[p - 1], got[p]
        top = row.topk(k).indices.tolist()
        assert list(entry)[0] == str(tok) and set(entry) == {str(t) for t in [tok, *top]}, (p, entry)
        lo, hi = _rank_bounds(row, tok)
        assert lo <= entry[str(tok)]["rank"] <= hi, (p, entry, lo, hi)
        for i, t in enumerate(top):
            if t != tok:
                assert entry[str(t)]["rank"] == i + 1, (p, entry)
        for t, e in entry.items():
            assert e["logprob"] == pytest.approx(row[int(t)].item(), abs=1e-4) and e["decoded_token"] == name(int(t))


def test_prompt_logprobs_in_vllms_shape(served, hf):
    """vLLM's prompt_logprobs against transformers: on a completion that generates nothing and one that does with n
    = 2 (every choice carries its prompt's), beside echo's own logprobs (which keep their own k), and on a chat
    (beside the choices)."""
    tok = served.tokenizer
    name = lambda t: tok.decode([t])  # noqa: E731
    ids = PROMPT
    want = hf_logprobs(hf, ids)
    got = complete(served, prompt=ids, prompt_logprobs=2, max_tokens=0)
    assert got["choices"][0]["text"] == "" and got["usage"]["completion_tokens"] == 0
    check_prompt_logprobs(got["choices"][0]["prompt_logprobs"], ids, want, 2, name)
    assert sum(e[str(ids[p])]["rank"] > 1 for p, e in enumerate(got["choices"][0]["prompt_logprobs"]) if e) > 1
    both = complete(served, prompt=ids, prompt_logprobs=3, echo=True, logprobs=1, max_tokens=2, n=2, **GREEDY)
    for choice in both["choices"]:
        check_prompt_logprobs(choice["prompt_logprobs"], ids, want, 3, name)
        echoed = choice["logprobs"]["top_logprobs"][1:len(ids)]
        assert all(legacy_top(name, ids[p], want[p - 1], 1) == pytest.approx(e, abs=1e-4)
                   for p, e in zip(range(1, len(ids)), echoed))
    assert "prompt_logprobs" not in complete(served, prompt=ids, max_tokens=1)["choices"][0]
    code, _ = post(served, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "stream": True,
                                               "prompt_logprobs": 0})     # vLLM takes 0 with stream
    assert code == 200
    chat = chat_ids(tok, CHAT)
    code, data = post(served, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                       "prompt_logprobs": 1})
    assert code == 200, data
    check_prompt_logprobs(data["prompt_logprobs"], chat, hf_logprobs(hf, chat), 1, name)
    assert "prompt_logprobs" not in data["choices"][0]


def test_generated_logprobs_equal_transformers(served, hf):
    tok = served.tokenizer
    name = lambda t: tok.decode([t])  # noqa: E731
    n, k = 8, 2
    got = complete(served, prompt=PROMPT, logprobs=k, max_tokens=n, **GREEDY)["choices"][0]
    want = hf_logprobs(hf, PROMPT + served.plain)[len(PROMPT) - 1:]
    assert [t for t in want.argmax(-1).tolist()] == served.plain         # greedy is transformers' argmax
    lp = got["logprobs"]
    text = tok.decode(served.plain, skip_special_tokens=True)
    assert got["text"] == text and lp["tokens"] == [name(t) for t in served.plain]
    for i, t in enumerate(served.plain):
        assert lp["token_logprobs"][i] == pytest.approx(want[i, t].item(), abs=1e-4), i
        assert_close_dicts(lp["top_logprobs"][i], legacy_top(name, t, want[i], k))
    check_offsets(tok, text, served.plain, lp["tokens"], lp["text_offset"], 0)
    # echo + generation: the prompt's positions, then these, offsets running on through the prompt's text
    both = complete(served, prompt=PROMPT, echo=True, logprobs=k, max_tokens=n, **GREEDY)["choices"][0]
    prompt_text = tok.decode(PROMPT)
    assert both["text"] == prompt_text + text
    assert both["logprobs"]["tokens"] == [name(t) for t in PROMPT] + lp["tokens"]
    assert both["logprobs"]["token_logprobs"][len(PROMPT):] == pytest.approx(lp["token_logprobs"], abs=1e-6)
    assert both["logprobs"]["text_offset"][len(PROMPT):] == [len(prompt_text) + o for o in lp["text_offset"]]
    check_offsets(tok, both["text"], PROMPT + served.plain, both["logprobs"]["tokens"],
                  both["logprobs"]["text_offset"], 0)
    # streamed: the same positions, each chunk's tokens already in the text sent with it or before
    code, chunks = post(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "logprobs": k,
                                                     "max_tokens": n, "stream": True, **GREEDY})
    assert code == 200
    text_so_far, tokens, values, offsets = "", [], [], []
    for c in chunks:
        part = c["choices"][0]
        text_so_far += part["text"]
        tokens += part["logprobs"]["tokens"]
        values += part["logprobs"]["token_logprobs"]
        offsets += part["logprobs"]["text_offset"]
        assert all(o + len(t) <= len(text_so_far) for t, o in zip(tokens, offsets) if "\ufffd" not in t)
    assert text_so_far == text and tokens == lp["tokens"] and offsets == lp["text_offset"]
    assert values == pytest.approx(lp["token_logprobs"], abs=1e-6)


def test_token_ids_beside_the_text_and_tokens_named_by_id(served):
    """vLLM's return_token_ids: the prompt's ids and the generated ones (`LLM.generate`'s, the EOS that ends a
    choice included, though not in its text), in one body and as deltas of a stream whose first chunk has the
    prompt's, on completions and chat; return_tokens_as_token_ids names logprobs' tokens "token_id:N"."""
    tok = served.tokenizer
    got = complete(served, prompt=PROMPT, max_tokens=8, return_token_ids=True, **GREEDY)["choices"][0]
    assert got["prompt_token_ids"] == PROMPT and got["token_ids"] == served.plain
    assert "token_ids" not in complete(served, prompt=PROMPT, max_tokens=2, **GREEDY)["choices"][0]
    text = "Hello experts"
    got = complete(served, prompt=text, max_tokens=2, return_token_ids=True, **GREEDY)["choices"][0]
    assert got["prompt_token_ids"] == tok.encode(text) and len(got["token_ids"]) == 2
    eos = tok.eos_token_id      # forced: it ends the choice, and is one of its ids but not in its text
    got = complete(served, prompt=PROMPT, max_tokens=3, logit_bias={str(eos): 100}, temperature=0,
                   return_token_ids=True)["choices"][0]
    assert (got["token_ids"], got["text"], got["finish_reason"]) == ([eos], "", "stop"), got
    code, chunks = post(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                     "stream": True, "return_token_ids": True, **GREEDY})
    assert code == 200
    parts = [c["choices"][0] for c in chunks]
    assert parts[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in p for p in parts[1:])
    assert [t for p in parts for t in p["token_ids"]] == served.plain
    # a token without text (a special one, skipped) still goes out as it comes, one chunk per token
    code, chunks = post(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                     "logit_bias": {str(eos): 100}, "stream": True,
                                                     "return_token_ids": True, **GREEDY})
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[eos]] * 3, chunks
    chat_plain = served.chat_expected[0].token_ids
    code, data = post(served, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                       "return_token_ids": True, **GREEDY})
    assert code == 200 and data["prompt_token_ids"] == chat_ids(tok, CHAT), data
    assert data["choices"][0]["token_ids"] == chat_plain
    code, chunks = post(served, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                         "stream": True, "return_token_ids": True, **GREEDY})
    assert code == 200 and chunks[0]["prompt_token_ids"] == chat_ids(tok, CHAT)
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == chat_plain
    code, chunks = post(served, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, "n": 2,
                                                         "stream": True, "return_token_ids": True, **GREEDY})
    firsts = [c for c in chunks if "prompt_token_ids" in c]        # each choice's first chunk, as vLLM
    assert code == 200 and sorted(c["choices"][0]["index"] for c in firsts) == [0, 1], firsts
    # tokens named by id
    lp = complete(served, prompt=PROMPT, max_tokens=8, logprobs=2, echo=True, return_tokens_as_token_ids=True,
                  **GREEDY)["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in PROMPT + served.plain]
    assert all(re.fullmatch(r"token_id:\d+", key) for top in lp["top_logprobs"][1:] for key in top)
    code, data = post(served, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                       "logprobs": True, "top_logprobs": 2,
                                                       "return_tokens_as_token_ids": True, **GREEDY})
    content = data["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat_plain]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert all(re.fullmatch(r"token_id:\d+", t["token"]) for e in content for t in e["top_logprobs"])


def test_structured_outputs_from_every_field_that_sets_them(served):
    """OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs and its older guided_* fields
    give LLM.generate's greedy text under the same spec (streamed too), which follows it; two such fields, an
    unserved response_format type, a grammar that does not compile and ignore_eos are 400s naming the field."""
    want = {k: out.text for k, out in served.structured.items()}
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", want["regex"]) and json.loads(want["json"]) in ("yes", "no")
    assert want["choice"] in ("red", "green", "blue") and isinstance(json.loads(want["json_object"]), dict)
    base = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    for fields, case in (({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, "regex"),
                         ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, "regex"),
                         ({"guided_json": YES_NO}, "json"), ({"guided_json": json.dumps(YES_NO)}, "json"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": YES_NO}}},
                          "json"),
                         ({"response_format": {"type": "json_object"}}, "json_object"),
                         ({"guided_choice": ["red", "green", "blue"]}, "choice"),
                         ({"structured_outputs": {"choice": ["red", "green", "blue"], "json": None,
                                                  "disable_fallback": True, "_backend": None,
                                                  "disable_additional_properties": False}}, "choice")):
        choice = complete(served, **base, **fields)["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (want[case], "stop"), (fields, choice)
    code, chunks = post(served, "/v1/completions", {"model": MODEL, **base, "guided_regex": r"[0-9]{3}-[a-z]{2}",
                                                     "stream": True})
    assert code == 200 and "".join(c["choices"][0]["text"] for c in chunks) == want["regex"]
    # a schema holding an integer msgpack cannot carry travels as text: answered, and the engine goes on
    code, data = post(served, "/v1/completions", {"model": MODEL, **base, "max_tokens": 2,
                                                  "guided_json": {"enum": ["yes", "no"], "default": 10**20}})
    assert code == 200 and data["choices"][0]["text"] in ('"', '"y', '"n'), data
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    code, data = post(served, "/v1/chat/completions", {**chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": YES_NO}}})
    assert code == 200 and json.loads(data["choices"][0]["message"]["content"]) in ("yes", "no"), data
    for fields, param in (({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
                          ({"response_format": {"type": "json_schema"}}, "response_format"),
                          ({"response_format": {"type": "xml"}}, "response_format"),
                          ({"guided_regex": "[a-"}, "guided_regex"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
                           "response_format"),
                          ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
                          ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
                          ({"structured_outputs": {"regex": "a+", "disable_additional_properties": True}},
                           "structured_outputs.disable_additional_properties"),
                          ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos")):
        code, data = post(served, "/v1/completions", {"model": MODEL, **base, **fields})
        assert code == 400 and data["error"]["param"] == param, (fields, data)


def test_chat_template_kwargs_reach_the_template(served):
    """vLLM's chat_template_kwargs are the template's variables (here add_generation_prompt, which the tiny template
    reads), on chat and /tokenize; apply_chat_template's own arguments, a per-request chat_template and chat's echo
    are 400s naming the field."""
    tok = served.tokenizer
    bare = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False),
                      add_special_tokens=False)
    assert bare != chat_ids(tok, CHAT)
    code, data = post(served, "/tokenize", {"model": MODEL, "messages": CHAT,
                                            "chat_template_kwargs": {"add_generation_prompt": False}})
    assert code == 200 and data["tokens"] == bare, data
    code, data = post(served, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                       "chat_template_kwargs": {"add_generation_prompt": False}})
    assert code == 200 and data["usage"]["prompt_tokens"] == len(bare), data
    for fields, param in (({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                          ({"chat_template": "{{ messages }}"}, "chat_template"), ({"echo": True}, "echo")):
        code, data = post(served, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, **fields})
        assert code == 400 and data["error"]["param"] == param, (fields, data)


def test_stop_string_keeps_streamed_logprobs_aligned(served):
    """A stop string holds text back: tokens wait for their text; the ones it cuts come with the last chunk."""
    tok = served.tokenizer
    text = tok.decode(served.plain, skip_special_tokens=True)
    stop = next(text[i:i + 3] for i in range(2, len(text) - 3) if "\ufffd" not in text[i:i + 3]
                and text.find(text[i:i + 3]) == i)
    body = {"model": MODEL, "prompt": PROMPT, "logprobs": 1, "max_tokens": 8, "stop": [stop], **GREEDY}
    whole = complete(served, **{k: v for k, v in body.items() if k != "model"})
    code, chunks = post(served, "/v1/completions", {**body, "stream": True})
    assert code == 200
    text_so_far, tokens, offsets = "", [], []
    for c in chunks:
        part = c["choices"][0]
        text_so_far += part["text"]
        tokens += part["logprobs"]["tokens"]
        offsets += part["logprobs"]["text_offset"]
        if part["finish_reason"] is None:
            assert all(o + len(t) <= len(text_so_far) for t, o in zip(tokens, offsets) if "\ufffd" not in t)
    assert text_so_far == whole["choices"][0]["text"] == text[:text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == whole["usage"]["completion_tokens"] and max(offsets) <= len(text_so_far)


def test_chat_logprobs_equal_transformers(served, hf):
    tok = served.tokenizer
    messages = [{"role": "user", "content": "Hello experts"}]
    ids = chat_ids(tok, messages)
    n, k = 5, 3
    body = {"model": MODEL, "messages": messages, "max_tokens": n, "logprobs": True, "top_logprobs": k, **GREEDY}
    code, got = post(served, "/v1/chat/completions", body)
    assert code == 200, got
    content = got["choices"][0]["logprobs"]["content"]
    gen = []
    for _ in range(n):     # transformers' greedy continuation, one token at a time (the 0 is never read)
        gen.append(int(hf_logprobs(hf, ids + gen + [0])[-1].argmax()))
    want = hf_logprobs(hf, ids + gen)[len(ids) - 1:]
    assert [e["token"] for e in content] == [tok.decode([t]) for t in gen]
    for i, (e, t) in enumerate(zip(content, gen)):
        assert e["logprob"] == pytest.approx(want[i, t].item(), abs=1e-4), i
        assert e["bytes"] == list(e["token"].encode())
        top = want[i].topk(k)
        assert [x["token"] for x in e["top_logprobs"]] == [tok.decode([j]) for j in top.indices.tolist()]
        assert [x["logprob"] for x in e["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert all(x["bytes"] == list(x["token"].encode()) for x in e["top_logprobs"])
    code, chunks = post(served, "/v1/chat/completions", {**body, "stream": True})
    assert code == 200
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-6)
    code, plain = post(served, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert code == 200 and plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"]["content"] == got["choices"][0]["message"]["content"]


def test_sampled_chat_top_logprobs_are_the_most_likely(served, hf):
    """Sampled tokens are often not the likeliest: top_logprobs still lists transformers' top k, and the
    token's own logprob is its entry."""
    tok, k = served.tokenizer, 2
    ids, gen = chat_ids(tok, CHAT), served.chat_sampled.token_ids
    code, got = post(served, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                                       "temperature": 1.0, "seed": SEED, "ignore_eos": True,
                                                       "logprobs": True, "top_logprobs": k})
    assert code == 200, got
    content = got["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [tok.decode([t]) for t in gen]      # the seed held
    want = hf_logprobs(hf, ids + gen)[len(ids) - 1:]
    assert any(t not in want[i].topk(k).indices.tolist() for i, t in enumerate(gen))
    for i, (e, t) in enumerate(zip(content, gen)):
        assert e["logprob"] == pytest.approx(want[i, t].item(), abs=1e-4), i
        top = want[i].topk(k)
        assert [x["token"] for x in e["top_logprobs"]] == [tok.decode([j]) for j in top.indices.tolist()]
        assert [x["logprob"] for x in e["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("case", ["presence", "frequency", "repetition", "logit_bias", "min_tokens"])
def test_penalties_and_logit_bias_act_as_in_generate(served, case):
    fields, want = served.expected[case]
    assert want.token_ids != served.plain, "the case must change the greedy output to show anything"
    got = complete(served, prompt=PROMPT, max_tokens=8, logprobs=0, **GREEDY, **fields)["choices"][0]
    assert got["text"] == want.text and got["finish_reason"] == want.finish_reason
    assert got["logprobs"]["tokens"] == [served.tokenizer.decode([t]) for t in want.token_ids]


def test_logit_bias_in_chat_acts_as_in_generate(served):
    plain, want = served.chat_expected
    assert want.token_ids != plain.token_ids
    bias = {str(plain.token_ids[0]): -100, "65": 6.5}
    code, got = post(served, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                       "logprobs": True, "logit_bias": bias, **GREEDY})
    assert code == 200, got
    assert got["choices"][0]["message"]["content"] == want.text
    assert [e["token"] for e in got["choices"][0]["logprobs"]["content"]] == [
        served.tokenizer.decode([t]) for t in want.token_ids]


def test_output_changing_extensions_at_their_defaults_are_taken(served, caplog):
    """vLLM's fields that this server refuses when they would change the output pass at their defaults, and are
    not called ignored (vLLM knows them)."""
    with caplog.at_level("WARNING", logger="afserve.http"):
        got = complete(served, prompt=PROMPT, max_tokens=2, use_beam_search=False, priority=0, logits_processors=None,
                       zz_unknown=1, **GREEDY)
    assert got["choices"][0]["finish_reason"] == "length"
    warned = [r.getMessage() for r in caplog.records if "were present in the request but ignored" in r.getMessage()]
    assert len(warned) == 1 and "'zz_unknown'" in warned[0] and "priority" not in warned[0], warned


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"best_of": 2, "n": 3}, "best_of"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"n": 2, "best_of": 1, "echo": True, "max_tokens": 0}, "best_of"),
    ("/v1/completions", {"n": 65}, "n"),
    ("/v1/completions", {"n": MAX_SEQS + 1}, "n"),
    ("/v1/completions", {"n": 2, "best_of": MAX_SEQS + 1}, "best_of"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logit_bias": {"1.5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"priority": 1}, "priority"),
    ("/v1/completions", {"logits_processors": ["my.module:Proc"]}, "logits_processors"),
    ("/v1/completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
])
def test_bad_values_get_a_400_naming_the_field(served, path, fields, param):
    body = {"model": MODEL, **({"prompt": "hi"} if path == "/v1/completions" else
                                {"messages": [{"role": "user", "content": "hi"}]}), **fields}
    code, data = post(served, path, body)
    assert code == 400 and data["error"]["param"] == param, data


def _metrics(served: Served) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def _prefix_counters(served: Served) -> tuple[float, float]:
    text = _metrics(served)
    found = [re.search(rf"^afserve_prefix_cache_{kind}_total (\S+)$", text, re.M) for kind in ("queries", "hits")]
    assert all(found), text[-2000:]
    return float(found[0].group(1)), float(found[1].group(1))


def test_prefix_cache_counters_count_cached_tokens(served):
    """A 40-token prompt, twice: the second finds its first 2 full blocks of 16 (the block that holds the
    prompt's last token is always computed, so at most (40 - 1) // 16 blocks), 32 tokens."""
    prompt = make_prompts(1, 256, 40, 40, seed=1234)[0]
    q0, h0 = _prefix_counters(served)
    complete(served, prompt=prompt, max_tokens=1, **GREEDY)
    q1, h1 = _prefix_counters(served)
    again = complete(served, prompt=prompt, max_tokens=1, **GREEDY)
    q2, h2 = _prefix_counters(served)
    assert (q1 - q0, h1 - h0) == (40, 0)
    assert (q2 - q1, h2 - h1) == (40, 32)
    # this server runs without vLLM's --enable-prompt-tokens-details: usage does not say what was cached
    assert again["usage"] == {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}
    # vLLM's cache_salt: the same prompt under a salt finds nothing, then its own blocks
    hits = []
    for _ in range(2):
        complete(served, prompt=prompt, max_tokens=1, cache_salt="tenant-a", **GREEDY)
        hits.append(_prefix_counters(served)[1] - h2 - sum(hits))
    assert hits == [0, 32]
    code, data = post(served, "/v1/completions", {"model": MODEL, "prompt": prompt, "cache_salt": ""})
    assert code == 400 and data["error"]["param"] == "cache_salt", data


# ----- n and best_of -------------------------------------------------------------------------------------------
def _text(served: Served, ids: list[int]) -> str:
    return served.tokenizer.decode(ids, skip_special_tokens=True)


def test_n_choices_are_generates_samples_in_order(served):
    """n=2 with a seed: choice i is LLM.generate's sample i (its tokens, their text), again when repeated; a
    batch of 2 prompts gives indexes 0..3, prompt by prompt; usage counts each prompt once and every sample's
    tokens; streamed, each chunk carries one choice."""
    tok = served.tokenizer
    want = [s.token_ids for out in served.samples for s in out.samples]     # PROMPT's 2 samples, then OTHER's
    assert len({tuple(w) for w in want}) == 4, "the samples must differ for their order to show"
    for _ in range(2):
        got = complete(served, prompt=PROMPT, n=2, logprobs=0, **SAMPLED)
        assert [c["index"] for c in got["choices"]] == [0, 1]
        for c, ids in zip(got["choices"], want):
            assert c["text"] == _text(served, ids) and c["finish_reason"] == "length"
            assert c["logprobs"]["tokens"] == [tok.decode([t]) for t in ids]
        assert got["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 12,
                                "total_tokens": len(PROMPT) + 12}
    body = {"model": MODEL, "prompt": [PROMPT, OTHER], "n": 2, **SAMPLED}
    got = complete(served, **{k: v for k, v in body.items() if k != "model"})
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in got["choices"]] == [_text(served, ids) for ids in want]
    assert got["usage"]["prompt_tokens"] == len(PROMPT) + len(OTHER) and got["usage"]["completion_tokens"] == 24
    code, chunks = post(served, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert code == 200
    texts = [""] * 4
    for chunk in chunks[:-1]:
        (part,) = chunk["choices"]
        texts[part["index"]] += part["text"]
    assert texts == [_text(served, ids) for ids in want] and chunks[-1]["usage"] == got["usage"]


def test_greedy_n_repeats_the_greedy_text_in_completions_and_chat(served):
    text = _text(served, served.plain)        # transformers' greedy (test_generated_logprobs_equal_transformers)
    got = complete(served, prompt=PROMPT, n=2, max_tokens=8, **GREEDY)
    assert [(c["index"], c["text"]) for c in got["choices"]] == [(0, text), (1, text)]
    assert got["usage"]["prompt_tokens"] == len(PROMPT) and got["usage"]["completion_tokens"] == 16
    plain = _text(served, served.chat_expected[0].token_ids)
    body = {"model": MODEL, "messages": CHAT, "n": 3, "max_tokens": 4, **GREEDY}
    code, got = post(served, "/v1/chat/completions", body)
    assert code == 200, got
    assert [(c["index"], c["message"]["content"]) for c in got["choices"]] == [(i, plain) for i in range(3)]
    assert got["usage"] == {"prompt_tokens": len(chat_ids(served.tokenizer, CHAT)), "completion_tokens": 12,
                            "total_tokens": len(chat_ids(served.tokenizer, CHAT)) + 12}
    code, chunks = post(served, "/v1/chat/completions", {**body, "stream": True})
    assert code == 200
    texts, roles = [""] * 3, []
    for chunk in chunks:
        (part,) = chunk["choices"]
        roles += [part["index"]] if part["delta"].get("role") else []
        texts[part["index"]] += part["delta"].get("content", "")
    assert roles == [0, 1, 2] and texts == [plain] * 3


def test_best_of_returns_the_n_samples_with_the_highest_summed_logprob(served):
    """best_of=3: the n of the 3 samples (the same draws as n=3, sample i seeded seed + i) whose tokens have the
    highest summed logprob, best first, as LLM.generate returns them; logprobs only when asked; usage counts the
    returned samples (vLLM's)."""
    best = served.best.samples
    assert [s.index for s in best] != [0, 1], "the best must not be the first n for the ranking to show"
    got = complete(served, prompt=PROMPT, n=1, best_of=3, **RANKED)
    (c,) = got["choices"]
    assert (c["index"], c["text"], c["logprobs"]) == (0, _text(served, best[0].token_ids), None)
    assert got["usage"]["completion_tokens"] == 6
    every = complete(served, prompt=PROMPT, n=3, logprobs=0, **RANKED)["choices"]
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    got = complete(served, prompt=[OTHER, PROMPT], n=2, best_of=3, logprobs=0, **RANKED)
    choices = got["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices[2:]] == [c["text"] for c in ranked[:2]] == [
        _text(served, s.token_ids) for s in best]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert sums[0] >= sums[1] and sums[2] >= sums[3]
    assert got["usage"] == {"prompt_tokens": len(PROMPT) + len(OTHER), "completion_tokens": 24,
                            "total_tokens": len(PROMPT) + len(OTHER) + 24}


def test_echo_with_n_gives_every_choice_the_scored_prompt(served):
    """Prompt logprobs come with sample 0 only: every choice still shows them, streamed and not; with
    max_tokens 0 the one scored prompt fills every choice."""
    one = complete(served, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, **GREEDY)["choices"][0]
    lp = one["logprobs"]
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]

    def assert_same(got: dict, upto: int) -> None:
        assert got["tokens"] == lp["tokens"][:upto] and got["text_offset"] == lp["text_offset"][:upto]
        assert got["token_logprobs"] == pytest.approx(lp["token_logprobs"][:upto], abs=1e-6)

    got = complete(served, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, n=2, **GREEDY)
    for c in got["choices"]:
        assert c["text"] == one["text"]
        assert_same(c["logprobs"], len(lp["tokens"]))
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "n": 2, "stream": True,
            **GREEDY}
    code, chunks = post(served, "/v1/completions", body)
    assert code == 200
    streamed = [{"tokens": [], "token_logprobs": [], "text_offset": []} for _ in range(2)]
    for chunk in chunks:
        (part,) = chunk["choices"]
        for key, values in streamed[part["index"]].items():
            values += part["logprobs"][key]
    for s in streamed:
        assert_same(s, len(lp["tokens"]))
    zero = complete(served, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, n=2)
    prompt_text = served.tokenizer.decode(PROMPT)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in zero["choices"]] == [
        (0, prompt_text, "length"), (1, prompt_text, "length")]
    for c in zero["choices"]:
        assert_same(c["logprobs"], len(PROMPT))
    assert zero["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "total_tokens": len(PROMPT)}


@contextlib.contextmanager
def engine_finishes(served: Served):
    """{sample id: finish reason} of every sample row the engine sends meanwhile, also those the front no
    longer routes (a spy on the router)."""
    client, finishes = served.client, {}
    deliver = client._deliver

    def spy(rows):
        finishes.update({row[0]: row[2] for row in rows if "#" in row[0] and row[2] is not None})
        deliver(rows)

    client._deliver = spy
    try:
        yield finishes
    finally:
        del client._deliver


def test_a_stop_string_ends_only_its_own_sample(served):
    """The stop string shows early in sample 0's text only: the engine aborts sample 0 and runs sample 1 on to
    max_tokens (its text whole)."""
    body = {"prompt": PROMPT, "n": 2, **SAMPLED, "max_tokens": 32}
    a, b = (c["text"] for c in complete(served, **body)["choices"])
    stop = next((a[i:j] for j in range(2, len(a) + 1) for i in range(1, j) if a[i:j] not in b
                 and a.find(a[i:j]) == i and "\ufffd" not in a[i:j]), None)
    assert stop is not None and a.index(stop) + len(stop) < len(a) // 2, (a, b, stop)
    with engine_finishes(served) as finishes:
        got = complete(served, **body, stop=[stop])
    assert [(c["text"], c["finish_reason"]) for c in got["choices"]] == [(a[:a.index(stop)], "stop"), (b, "length")]
    assert sorted(finishes.values()) == ["abort", "length"], finishes


def test_client_gone_mid_stream_aborts_every_sample_and_frees_kv(served):
    """The engine ends both samples with "abort" (a sample left running would end with "length"), and every KV
    block is free again."""

    def kv_used() -> int:
        return sum(int(float(v)) for v in re.findall(r'^afserve_kv_blocks_used\{rank="\d+"\} (\S+)$',
                                                     _metrics(served), re.M))

    with engine_finishes(served) as finishes:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
        body = {"model": MODEL, "prompt": PROMPT, "n": 2, "max_tokens": MAX_LEN - len(PROMPT), "stream": True,
                **GREEDY}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read(6) == b"data: "     # generating: the samples hold KV blocks
        conn.sock.close()
        conn.close()
        deadline = time.monotonic() + 20
        while (len(finishes) < 2 or kv_used()) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert sorted(finishes.values()) == ["abort", "abort"], finishes
    assert kv_used() == 0
    assert re.search(r"^afserve_requests_running 0\.0$", _metrics(served), re.M)
