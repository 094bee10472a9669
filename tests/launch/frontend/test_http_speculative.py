"""The server with speculative decoding on (prompt lookup on the shipped model, drafts accepted several at a time):
a stop string that falls inside a step's emitted tokens still ends the text right before it, streamed or not, as
the same request gives without speculation (LLM.generate, transformers-equal, is the reference)."""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from launch import LLM, SamplingParams
from launch.local_server import LocalServer
from models import SHIPPED_MODEL

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = "To be, or not to be, to be, or not to be, to be, or not"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server():
    with LocalServer(SHIPPED_MODEL, nproc=2, args=["--attention-ranks", "1", "--speculative-config",
                                                  json.dumps(NGRAM)]) as srv:
        yield srv


def test_stop_strings_cut_inside_a_steps_drafts(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    with LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1) as llm:
        text = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].text
    # stop strings at several places of the text (each at its first occurrence)
    stops = [text[i:i + 3] for i in range(4, len(text) - 3, max(1, len(text) // 8)) if text.find(text[i:i + 3]) == i]
    assert len(stops) >= 4, text
    for stop in stops:
        for stream in (False, True):
            res = client.completions.create(model=SHIPPED_MODEL, prompt=PROMPT, temperature=0,
                                            max_tokens=MAX_TOKENS, stop=[stop], stream=stream,
                                            extra_body={"ignore_eos": True})
            if stream:
                chunks = list(res)
                out, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
            else:
                out, reason = res.choices[0].text, res.choices[0].finish_reason
            assert out == text[:text.index(stop)] and reason == "stop", (stream, stop, out, text)
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    accepted = [ln for ln in metrics.splitlines() if ln.startswith("afserve_spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0, accepted     # steps emitted several tokens
