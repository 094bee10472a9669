"""Stop strings in the Python API (vLLM's SamplingParams.stop and include_stop_str_in_output; launch/samples.py's
Gathering): against transformers' greedy tokens, decoded by the test: the output ends at the first token whose
text holds a stop string, its text before it (or through it), finish_reason "stop" and stop_reason the string; the
engine stops generating it, and nothing of it reaches later calls."""
from __future__ import annotations

import queue
from dataclasses import replace

import pytest
from conftest import hf_greedy, make_prompts
from transformers import AutoTokenizer

from launch import LLM, SamplingParams

MAX_NEW = 24


def stopped_at(tok, ids: list[int], stops: list[str]) -> tuple[int, str, int]:
    """(tokens up to the first whose text holds a stop string, the string seen first there, its position)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        found = sorted((text.find(s), s) for s in stops if s in text)
        if found:
            return k, found[0][1], found[0][0]
    raise AssertionError("no stop string in the output")


def test_stop_strings_end_outputs_where_transformers_text_holds_them(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    # prompts whose greedy outputs have plain text in them (the random model's byte tokens may leave characters
    # unfinished, whose text no stream shows until they are), and stops from it: two for the last, the one that
    # comes first in the text winning though listed second
    prompts = make_prompts(3, 256, 4, 10, seed=82)[1:] + make_prompts(3, 256, 4, 10, seed=83)[:1]
    stops = [["toy"], [" experts"], ["ks", "SS"]]
    full = hf_greedy(path, prompts, MAX_NEW)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in full]
    base = dict(max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(path, attention_ranks=1, expert_ranks=1, max_model_len=512) as llm:
        # room for 400 tokens: a stopped output goes no further in the engine
        outs = llm.generate(prompts, [SamplingParams(stop=s, max_tokens=400, ignore_eos=True) for s in stops])
        kept = llm.generate(prompts[:1], SamplingParams(stop=stops[0], include_stop_str_in_output=True, **base))[0]
        never = llm.generate(prompts[:1], SamplingParams(stop="\u2603never", **base))[0]
        by_id = llm.generate(prompts[:1], SamplingParams(stop_token_ids=[full[0][3]], **base))[0]
        # two seeded samples of one request: a stop that only one sample's text holds ends that one alone (its
        # tokens are the ones it draws without the stop: each sample has its own generator)
        sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
        free = [s.token_ids for s in llm.generate(prompts[:1], sampled)[0].samples]
        free_texts = [tok.decode(ids, skip_special_tokens=True) for ids in free]
        one = next(c for c in free_texts[0] + free_texts[1] if " " <= c <= "~" and (c in free_texts[0]) != (
            c in free_texts[1]))
        two = llm.generate(prompts[:1], replace(sampled, stop=[one]))[0]
        after = llm.generate(prompts[1:2], SamplingParams(max_tokens=5, ignore_eos=True))[0]
        stats = llm.stats()         # the stopped ones ended in the engine long before 400 tokens, their rows read
        assert stats["num_running"] == 0 and stats["steps"] < 200 and not llm._abandoned
        with pytest.raises(queue.Empty):
            llm.outbox.get(timeout=0.5)         # and none of their rows is left for another reader
    for out, ids, s in zip(outs, full, stops):
        k, first, at = stopped_at(tok, ids, s)
        assert k < len(ids) and (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:k], "stop", first)
        assert out.text == tok.decode(ids[:k], skip_special_tokens=True)[:at]
    k, first, at = stopped_at(tok, full[0], stops[0])
    assert kept.text == tok.decode(full[0][:k], skip_special_tokens=True)[:at + len(first)]
    assert (kept.token_ids, kept.stop_reason) == (full[0][:k], first)
    for sample, ids, text in zip(two.samples, free, free_texts):
        if one in text:
            k, _, at = stopped_at(tok, ids, [one])
            assert (sample.token_ids, sample.text, sample.finish_reason, sample.stop_reason) == (
                ids[:k], tok.decode(ids[:k], skip_special_tokens=True)[:at], "stop", one)
        else:
            assert (sample.token_ids, sample.text, sample.finish_reason) == (ids, text, "length")
    assert (never.token_ids, never.text, never.finish_reason, never.stop_reason) == (
        full[0], texts[0], "length", None)
    assert (by_id.token_ids, by_id.finish_reason, by_id.stop_reason) == (full[0][:4], "stop", full[0][3])
    assert after.token_ids == full[1][:5]
    with pytest.raises(ValueError, match=r"SamplingParams.stop=\[''\] is invalid"):
        SamplingParams(stop=[""])
