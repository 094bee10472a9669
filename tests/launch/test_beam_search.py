"""Beam search (vLLM's `LLM.beam_search` and the server's `use_beam_search`; launch/beam_search.py) against the
test's own beam search over transformers' log-probabilities: the same rules (2 * beam_width candidates per beam,
an EOS ends its beam, the best beam_width by summed log-probability each step, the answer ranked by that sum over
the length ** length_penalty), written here from the model's logits alone."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_model, make_prompts

from launch import LLM, BeamSearchParams

EOS = 2      # the tiny checkpoint's


def reference(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float = 1.0,
              ignore_eos: bool = False) -> list[tuple[list[int], float, str]]:
    """(generated ids, summed log-probability, finish reason) of the best `width` beams, best first."""
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, total in live:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.topk(torch.log_softmax(logits, -1), 2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t == EOS and not ignore_eos else grown).append((tokens + [t], total + lp))
        live = sorted(grown, key=lambda b: -b[1])[:width]

    def rank(beam):     # a final EOS is not counted in the length (vLLM's, after transformers')
        return beam[1] / (len(beam[0]) - (beam[0][-1] == EOS)) ** length_penalty
    best = sorted(done + live, key=lambda b: -rank(b))[:width]
    n = len(prompt)
    return [(b[0][n:-1], b[1], "stop") if b in done else (b[0][n:], b[1], "length") for b in best]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    with LLM(path, attention_ranks=1, expert_ranks=1, max_model_len=128) as llm:
        yield path, llm


@pytest.mark.parametrize("width, max_tokens, seed, options, stops", [
    (2, 6, 72, {}, False),
    (1, 5, 71, {}, False),
    (3, 8, 95, {}, True),                                     # beams ended by EOS, ranked with the live ones
    (3, 8, 98, {"length_penalty": 0.2}, True),
    (3, 8, 112, {"length_penalty": 2.0}, True),
    (3, 8, 95, {"ignore_eos": True}, False),                  # EOS is a token like another
    (3, 8, 112, {"include_stop_str_in_output": True}, True),  # the EOS that ended a beam stays in its tokens
])
def test_beams_are_the_reference_search_over_transformers(engine, width, max_tokens, seed, options, stops):
    path, llm = engine
    prompts = make_prompts(3, 256, 4, 12, seed=seed)
    model = hf_model(path)
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=max_tokens, **options))
    assert len(outs) == len(prompts)
    kept = options.get("include_stop_str_in_output", False)
    wanted = []
    for prompt, out in zip(prompts, outs):
        want = reference(model, prompt, width, max_tokens, options.get("length_penalty", 1.0),
                         options.get("ignore_eos", False))
        want = [(ids + [EOS] * (kept and why == "stop"), total, why) for ids, total, why in want]
        got = [(b.output_ids, b.cum_logprob, b.finish_reason) for b in out.sequences]
        assert [(g[0], g[2]) for g in got] == [(w[0], w[2]) for w in want]
        assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=1e-4)
        assert all(b.text == llm.decode(b.output_ids) and len(b.logprobs) == len(b.output_ids) for b in out.sequences)
        wanted += want
    assert any(why == "stop" for _, _, why in wanted) == stops      # the case does what it is here for


def test_bad_parameters_name_the_field(engine):
    _, llm = engine
    for fields, name in [({"beam_width": 0}, "beam_width=0"), ({"beam_width": 11}, "beam_width=11"),
                         ({"max_tokens": 0}, "max_tokens=0"), ({"temperature": -1.0}, "temperature=-1.0")]:
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})
    with pytest.raises(ValueError, match="max_tokens=200 = 204 exceeds max_model_len=128"):
        llm.beam_search([[5, 6, 7, 8]], BeamSearchParams(beam_width=2, max_tokens=200))


def test_the_server_answers_use_beam_search_with_the_reference_beams(tiny_checkpoint):
    """vLLM's use_beam_search: n beams per prompt (two prompts at once on completions, a chat on chat
    completions, with vLLM's return_token_ids), best first, each the reference's tokens, text and finish (an
    EOS-ended beam says which EOS); a stream, an echo, a width over 10, logprobs and a constrained output are 400s
    naming the field. max_num_seqs 2 does not bound the width (the steps are one-sample requests)."""
    from tests.launch.frontend.in_process import serving
    from tests.launch.frontend.test_http_logprobs import _prefix_counters, chat_ids, post

    path = tiny_checkpoint("qwen3_moe")
    model = hf_model(path)
    prompts = make_prompts(3, 256, 4, 12, seed=95)[:2]
    chat = [{"role": "user", "content": "Hello experts"}]
    with LLM(path, attention_ranks=1, expert_ranks=1, max_model_len=128, max_num_seqs=2) as llm, \
            serving(llm, path, "tiny") as (port, _):
        class Served:
            pass
        Served.port = port
        tok = llm.tokenizer
        fields = {"model": "tiny", "use_beam_search": True, "n": 3, "max_tokens": 8, "temperature": 0}
        code, got = post(Served, "/v1/completions", fields | {"prompt": prompts})
        assert code == 200, got
        want = [w for p in prompts for w in reference(model, p, 3, 8)]
        assert any(why == "stop" for _, _, why in want)
        assert [c["index"] for c in got["choices"]] == list(range(6))
        assert [(c["text"], c["finish_reason"], c["stop_reason"]) for c in got["choices"]] == [
            (tok.decode(ids, skip_special_tokens=True), why, EOS if why == "stop" else None) for ids, _, why in want]
        assert got["usage"]["completion_tokens"] == sum(len(ids) for ids, _, _ in want)
        code, got = post(Served, "/v1/chat/completions", fields | {"messages": chat, "return_token_ids": True})
        assert code == 200, got
        ids = chat_ids(tok, chat)
        want = reference(model, ids, 3, 8)
        assert [(c["message"]["content"], c["finish_reason"], c["token_ids"]) for c in got["choices"]] == [
            (tok.decode(out, skip_special_tokens=True), why, out) for out, _, why in want]
        assert got["prompt_token_ids"] == ids
        # the steps keep the request's cache_salt: a salted search finds none of the unsalted one's blocks, then
        # its own (a 40-token prompt: two whole blocks of 16 before its last token)
        long = make_prompts(1, 256, 40, 40, seed=96)[0]
        hits = []
        for salt in (None, "tenant", "tenant"):
            before = _prefix_counters(Served)[1]
            code, _ = post(Served, "/v1/completions", fields | {"prompt": long, "n": 1, "max_tokens": 1}
                           | ({"cache_salt": salt} if salt else {}))
            hits.append(_prefix_counters(Served)[1] - before)
        assert code == 200 and hits == [0, 0, 32]
        for extra, param in [({"stream": True}, "stream"), ({"echo": True}, "echo"), ({"n": 11}, "n"),
                             ({"logprobs": 2}, "logprobs"), ({"guided_regex": "a+"}, "guided_regex")]:
            code, err = post(Served, "/v1/completions", fields | {"prompt": prompts[0]} | extra)
            assert code == 400 and err["error"]["param"] == param, err


def test_score_survives_length_penalties_past_floats_range():
    """A length_penalty whose power of the length leaves float's range (a client's 5.6e21, found by the schema fuzz
    as a 500) scores as the limit of vLLM's quotient instead of raising: 0 for a huge positive penalty, -inf for a
    huge negative one (0 for a beam of probability 1); ordinary penalties keep the plain quotient."""
    import math

    from launch.beam_search import BeamSequence, score
    beam, sure = BeamSequence([5, 6, 7], cum_logprob=-2.5), BeamSequence([5, 6], cum_logprob=0.0)
    assert score(beam, frozenset(), 5.6e21) == 0.0 and score(beam, frozenset(), -5.6e21) == -math.inf
    assert score(sure, frozenset(), -5.6e21) == 0.0
    assert score(beam, frozenset(), 2.0) == -2.5 / 9 and score(beam, frozenset({7}), 1.0) == -2.5 / 2
    # an int's power would be computed exactly (for ever): taken as a float; NaN and inf are refused by name
    assert BeamSearchParams(2, 3, length_penalty=10**400).length_penalty == 1e308
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"BeamSearchParams\.length_penalty={bad} is invalid: pass a finite"):
            BeamSearchParams(2, 3, length_penalty=bad)
