"""Speculative decoding through the engine (attention_nodes/speculation.py): greedy outputs equal transformers'
with prompt-lookup drafts for every architecture and in several topologies and comm modes; with penalties,
logit bias, min_tokens, stop tokens, n > 1, logprobs, chunked prefill and preemption they equal the outputs
without speculation; the acceptance counts equal a replay of the drafts against the output; seeded sampling
stays reproducible."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from attention_nodes.spec_decode import ngram_propose
from launch import LLM, SamplingParams
from models import SHIPPED_MODEL
from models.tiny import ARCHS, make_tiny_checkpoint
from tests.conftest import FULL, hf_greedy, hf_model, make_prompts, wider

MAX_NEW = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def looping_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase, so that prompt lookup finds n-grams to propose from."""
    out = []
    for i, p in enumerate(make_prompts(n, 256, 4, 12, seed=seed)):
        out.append((p * 3)[:len(p) * 2 + i])
    return out


# CI runs the architectures whose attention or MoE differ most (GQA with q/k norms, MLA, half-rotary with shared
# experts, sinks with sliding windows); the wider matrix (make test-full) adds the other four.
SPEC_CI = ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")


@pytest.mark.parametrize("arch", [a if a in SPEC_CI else wider(a) for a in ARCHS])
def test_greedy_with_ngram_drafts_equals_transformers(tiny_checkpoint, arch):
    """Every architecture, 1+1, with chunked prefill (budget 24) and preemption (12 blocks of 16 tokens)."""
    path = tiny_checkpoint(arch)
    prompts = looping_prompts(6, seed=3) + [make_prompts(1, 256, 40, 40, seed=4)[0]]
    expected = hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, attention_ranks=1, expert_ranks=1, speculative_config=NGRAM, num_kv_blocks=12,
             max_num_batched_tokens=24, max_num_seqs=8) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        spec = llm.stats()["spec_decode"]
    assert [o.token_ids for o in outs] == expected
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]   # drafts were both accepted and rejected


@pytest.mark.parametrize("backend", ["torch", wider("sdpa"), "triton"])
def test_draft_rows_through_each_kernel_backend(tiny_checkpoint, backend):
    """A draft chunk runs as decode rows of one sequence (attention_nodes/batch.py): GPT-OSS's sinks and sliding
    windows through each backend's paged decode (the default cpu backend runs in the test above)."""
    if backend == "triton":
        pytest.importorskip("triton")
    path = tiny_checkpoint("gpt_oss")
    prompts = looping_prompts(3, seed=9)
    expected = hf_greedy(path, prompts, 8)
    with LLM(path, attention_ranks=1, expert_ranks=1, kernel_backend=backend, speculative_config=NGRAM) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        spec = llm.stats()["spec_decode"]
    assert [o.token_ids for o in outs] == expected and spec["num_draft_tokens"] > 0


@pytest.mark.parametrize("attention_ranks,expert_ranks,comm", [(2, 2, "two_phase"), wider(1, 3, "direct"),
                                                                wider(2, 2, "direct")])
def test_deepseek_v3_topologies_with_micro_batches(tiny_checkpoint, attention_ranks, expert_ranks, comm):
    """Draft chunks go through two_phase and the ping-pong micro-batches (never cut between two)."""
    path = tiny_checkpoint("deepseek_v3")
    prompts = looping_prompts(8, seed=5)
    expected = hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, attention_ranks=attention_ranks, expert_ranks=expert_ranks, comm=comm, ranks_per_node=2,
             micro_batches=2, micro_batch_min_tokens=0, speculative_config=NGRAM) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["spec_decode"]["num_accepted_tokens"] > 0 and stats["num_micro_batched_steps"] > 0


def _lookup(tokens: list[int], room: int) -> list[int]:
    return ngram_propose(np.asarray(tokens), room, NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"]).tolist()


def _replayed_counts(prompt: list[int], output: list[int], max_tokens: int, propose=_lookup, k: int = 3
                     ) -> tuple[int, int, int, list[int]]:
    """What one request's drafts must have been: from its first output token on, each step proposes from the
    tokens so far (as the drafter does) and accepts the drafts that the output continues with."""
    tokens = prompt + output
    pos, drafts, draft_tokens, accepted, per_pos = len(prompt) + 1, 0, 0, 0, [0] * k
    while pos - len(prompt) < max_tokens:
        room = min(k, max_tokens - (pos - len(prompt)) - 1)
        d = propose(tokens[:pos], room) if room > 0 else []
        a = 0
        while a < len(d) and d[a] == tokens[pos + a]:
            a += 1
        drafts, draft_tokens, accepted = drafts + bool(d), draft_tokens + len(d), accepted + a
        for j in range(a):
            per_pos[j] += 1
        pos += a + 1
    return drafts, draft_tokens, accepted, per_pos


def test_shipped_model_counts_equal_a_replay_of_its_drafts():
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    prompts = [tok.encode(t) for t in ("ROMEO:\nBut soft, what light", "To be, or not to be, that is")]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1, speculative_config=NGRAM) as llm:
        outs = llm.generate(prompts, params)
        spec = llm.stats()["spec_decode"]
    assert [o.token_ids for o in outs] == plain
    want = [sum(x) for x in zip(*[_replayed_counts(p, o, 40)[:3] for p, o in zip(prompts, plain)])]
    per_pos = [sum(x) for x in zip(*[_replayed_counts(p, o, 40)[3] for p, o in zip(prompts, plain)])]
    assert [spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]] == want
    assert spec["num_accepted_tokens_per_pos"] == per_pos[:len(spec["num_accepted_tokens_per_pos"])]
    assert spec["num_accepted_tokens"] > 0


def assert_same_outputs(off: list[list], on: list[list]) -> None:
    """Per case, per request: the same samples' tokens, finish reasons and logprob entries (within 1e-4)."""
    for off_case, on_case in zip(off, on):
        for a, b in zip(off_case, on_case):
            assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
            assert [s.finish_reason for s in a.samples] == [s.finish_reason for s in b.samples]
            for sa, sb in zip(a.samples, b.samples):
                assert (sa.logprobs is None) == (sb.logprobs is None)
                for ea, eb in zip(sa.logprobs or [], sb.logprobs or []):
                    assert ea.keys() == eb.keys()
                    assert all(abs(ea[t] - eb[t]) < 1e-4 for t in ea)


def test_features_equal_the_outputs_without_speculation():
    """Penalties, bias, min_tokens and bad words (shaped as if the drafts before each row were generated),
    allowed_token_ids (alone and with those), stop tokens and EOS (nothing past them), n > 1, logprobs (the
    target's, of each token emitted) and max_tokens, with a small pool (preemption) and budget (chunked
    prefill)."""
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    prompts = [tok.encode(t) for t in ("ROMEO:\nBut soft, what light through yonder", "KING HENRY:\nOnce more",
                                       "To be, or not to be, that is the question", "JULIET:\nO Romeo, Romeo")]
    stop = tok.encode(" the")[-1:]
    allowed = sorted({t for p in prompts for t in p} | set(tok.encode(" of the and to in")))   # drafts come from these
    cases = [SamplingParams(max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
             SamplingParams(max_tokens=30, logit_bias={stop[0]: 3.0}, stop_token_ids=stop, min_tokens=5),
             SamplingParams(max_tokens=7, n=2, logprobs=3),
             SamplingParams(max_tokens=60, min_tokens=20),
             SamplingParams(max_tokens=20, allowed_token_ids=allowed),
             SamplingParams(max_tokens=20, allowed_token_ids=allowed, bad_words_token_ids=[tok.encode(" of the")],
                            repetition_penalty=1.1)]
    runs = []
    for spec in (None, NGRAM):
        with LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1, speculative_config=spec, num_kv_blocks=8,
                 max_num_batched_tokens=20, max_num_seqs=6) as llm:
            runs.append([llm.generate(prompts, p) for p in cases])
            stats = llm.stats()
    assert stats["spec_decode"]["num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0
    assert_same_outputs(*runs)
    stopped = [o for o in runs[1][1] if o.finish_reason == "stop"]
    assert stopped and all(o.token_ids[-1] == stop[0] and o.token_ids.count(stop[0]) == 1
                           for o in stopped)


def test_seeded_sampling_is_reproducible():
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    prompts = [tok.encode("ROMEO:\nBut soft, what light"), tok.encode("To be, or not to be")]
    params = SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=7, ignore_eos=True)
    with LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1, speculative_config=NGRAM) as llm:
        first = [o.token_ids for o in llm.generate(prompts, params)]
        second = [o.token_ids for o in llm.generate(prompts[::-1], params)][::-1]
        spec = llm.stats()["spec_decode"]
    assert first == second and spec["num_draft_tokens"] > 0


@pytest.mark.parametrize("victim", [1, 3])
def test_a_rank_lost_mid_stream(tiny_checkpoint, victim):
    """2+2 with drafts: attention rank 1 (its requests move and are recomputed; drafts are not carried, the next
    token proposes again) or expert rank 3 (the step in flight, draft chunks included, is run again) SIGKILLed
    while requests stream: every output is still transformers' greedy continuation."""
    from tests.launch.runtime.test_elastic import _stream
    path = tiny_checkpoint("qwen3_moe")
    prompts = looping_prompts(8, seed=11)
    expected = hf_greedy(path, prompts, 24)
    with LLM(path, attention_ranks=2, expert_ranks=2, speculative_config=NGRAM) as llm:
        pids = llm.worker_pids
        assert _stream(llm, prompts, SamplingParams(max_tokens=24, ignore_eos=True), pids[victim],
                       after_tokens=40) == expected
        stats = llm.stats()
    assert llm.lost_ranks == [victim] and stats["spec_decode"]["num_accepted_tokens"] > 0


@FULL   # ~17 s: make test-full (make test scales with a KV handover in test_elastic)
def test_scale_out_and_in_with_a_kv_handover(tiny_checkpoint):
    """1+2 -> 2+4 -> 1+2 under a steady stream with drafts on: the leaving attention rank hands its requests over
    with their KV blocks (not their drafts); every output is transformers' greedy continuation."""
    from tests.launch.runtime.test_elastic import scale_under_stream
    scale_under_stream(tiny_checkpoint("qwen3_moe"), transport="shm", speculative_config=NGRAM)


@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory) -> str:
    """A tiny dense model with the tiny checkpoints' vocabulary (a Qwen3-MoE config whose layers are all MLPs)."""
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("draft"), seed=1, mlp_only_layers=[0, 1])


@pytest.mark.parametrize("attention_ranks,expert_ranks,comm", [(1, 1, "direct"), (2, 2, "two_phase")])
def test_greedy_with_a_draft_model_equals_transformers(tiny_checkpoint, dense_draft, attention_ranks,
                                                       expert_ranks, comm):
    """method draft_model: the outputs are transformers' greedy continuation of the target, and the drafts
    verified are exactly the draft checkpoint's own greedy continuations (transformers' too) of each request's
    tokens so far: the counts equal a replay."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = looping_prompts(5, seed=13)
    expected = hf_greedy(path, prompts, MAX_NEW)
    cfg = {"method": "draft_model", "model": dense_draft, "num_speculative_tokens": 3}
    with LLM(path, attention_ranks=attention_ranks, expert_ranks=expert_ranks, comm=comm, ranks_per_node=2,
             micro_batches=2, micro_batch_min_tokens=0, speculative_config=cfg) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        spec = llm.stats()["spec_decode"]
    assert [o.token_ids for o in outs] == expected
    draft = hf_model(dense_draft)
    draft.generation_config.eos_token_id = None

    def greedy(tokens, room):
        with torch.no_grad():
            return draft.generate(torch.tensor([tokens]), max_new_tokens=room, do_sample=False,
                                  pad_token_id=0)[0, len(tokens):].tolist()
    replay = [_replayed_counts(p, o, MAX_NEW, greedy) for p, o in zip(prompts, expected)]
    assert [spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]] == \
        [sum(r[i] for r in replay) for i in range(3)]
