"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer (method "mtp", attention_nodes/mtp.py),
through the whole engine. Two oracles the runtime did not produce: transformers' greedy continuation of the target
(the outputs), and the reference MTP forward of tests/mtp_reference.py (the drafts): the counts of drafts and
accepted tokens must equal a replay of the reference's drafts against the output. The drafts themselves, step by
step, are checked in tests/attention_nodes/test_mtp_proposer.py.
"""
from __future__ import annotations

import os

import pytest

from launch import LLM, SamplingParams
from models.tiny import make_tiny_mtp_checkpoint
from tests.conftest import hf_greedy, make_prompts, wider
from tests.mtp_reference import ReferenceMTP
from tests.launch.test_speculative import _replayed_counts, assert_same_outputs

MAX_NEW = 16
K = 3


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory) -> str:
    return make_tiny_mtp_checkpoint(tmp_path_factory.mktemp("mtp"), seed=0)


@pytest.fixture(scope="module")
def reference(mtp_checkpoint, tmp_path_factory) -> ReferenceMTP:
    return ReferenceMTP(mtp_checkpoint, os.fspath(tmp_path_factory.mktemp("mtp_layer")))


def _prompts() -> list[list[int]]:
    return make_prompts(5, 256, 6, 30, seed=21)


@pytest.mark.parametrize("attention_ranks,expert_ranks,comm,micro_batches", [
    (1, 1, "direct", 1), (2, 2, "two_phase", 2), wider(1, 3, "direct", 2),
    wider(2, 2, "direct", 1), wider(1, 3, "two_phase", 1), wider(1, 1, "two_phase", 2)])
def test_greedy_with_mtp_equals_transformers_and_drafts_equal_the_reference(
        mtp_checkpoint, reference, attention_ranks, expert_ranks, comm, micro_batches):
    """Outputs: transformers' greedy continuation of the target. Counts: a replay of the reference MTP layer's
    drafts, so every draft was the reference's (the MTP layer's MoE ran on the expert ranks, its KV exact). With
    micro-batches, the target's hidden states come from both (prompt chunks cut between them)."""
    prompts = _prompts()
    expected = hf_greedy(mtp_checkpoint, prompts, MAX_NEW)
    cfg = {"method": "mtp", "num_speculative_tokens": K}
    with LLM(mtp_checkpoint, attention_ranks=attention_ranks, expert_ranks=expert_ranks, comm=comm,
             ranks_per_node=2, max_num_batched_tokens=24, micro_batches=micro_batches, micro_batch_min_tokens=0,
             speculative_config=cfg) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        spec = llm.stats()["spec_decode"]
    assert [o.token_ids for o in outs] == expected
    replay = [_replayed_counts(p, o, MAX_NEW, reference.drafts, K) for p, o in zip(prompts, expected)]
    want = [sum(r[i] for r in replay) for i in range(3)]
    assert [spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]] == want
    assert 0 < want[2] < want[1]     # drafts were both accepted and rejected


@pytest.mark.parametrize("arch,named", [
    ("qwen3_moe", "this one is 'qwen3_moe' with num_nextn_predict_layers=0: use method"),
    ("deepseek_v3", "has no multi-token-prediction layer 3 (no 'model.layers.3.eh_proj.weight')")])
def test_a_checkpoint_without_mtp_layers_is_refused_by_name(tiny_checkpoint, arch, named):
    """The front refuses it before any rank starts, naming what is missing and what to use instead (transformers'
    DeepSeek-V3 config says num_nextn_predict_layers=1 by default; the tiny checkpoint has no such layer)."""
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        LLM(tiny_checkpoint(arch), speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_mtp_steps_read_the_device_once_and_expert_ranks_never(mtp_checkpoint):
    """Under the sync audit, a decode step with MTP reads back only the emitted tokens (attention_nodes/speculation.py's
    host_read; the drafts stay on the device into the next step's batch and verification); the expert ranks serve
    the passes' exchanges with no read."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "attention_nodes", "speculation.py")) as f:
        (site,) = {f"attention_nodes/speculation.py:{n}" for n, line in enumerate(f, 1)
                   if "host_read(" in line and not line.lstrip().startswith(("from ", "import "))}
    with LLM(mtp_checkpoint, attention_ranks=1, expert_ranks=2, sync_audit=True, transport="collective",
             speculative_config={"method": "mtp", "num_speculative_tokens": K}) as llm:
        llm.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        ranks = llm.comm_stats()["ranks"]
    attention = ranks["0"]["host_syncs"]
    assert attention["sites"].get(site, 0) >= 1 and attention["max_per_decode_step"] == 1, attention
    assert sum(attention["sites"].values()) == attention["decode_steps"], attention
    for r in ("1", "2"):
        assert ranks[r]["host_syncs"]["decode_steps"] == attention["decode_steps"] > 0
        assert ranks[r]["host_syncs"]["max_per_decode_step"] == 0, ranks[r]["host_syncs"]


@pytest.mark.parametrize("victim", [3, 1])
def test_a_rank_killed_between_a_steps_forward_and_its_mtp_passes(mtp_checkpoint, monkeypatch, victim):
    """2+2 with MTP drafts: at step 6, once past the target's layers, expert rank 3 dies (the attention ranks have
    committed the step and are in its MTP passes) or attention rank 1 does (committed, before its passes)
    (AFSERVE_FAULT draft_passes). The job re-forms and re-sends the step: the committed ranks join its exchanges
    again and re-send their reports; attention rank 1's requests move and are recomputed. Every output is
    transformers' greedy continuation, within a watchdog."""
    from tests.dist_utils import alive
    from tests.launch.runtime.test_elastic import _stream
    prompts = _prompts()
    expected = hf_greedy(mtp_checkpoint, prompts, 24)
    monkeypatch.setenv("AFSERVE_FAULT", f"draft_passes:{victim}:6")
    with LLM(mtp_checkpoint, attention_ranks=2, expert_ranks=2,
             speculative_config={"method": "mtp", "num_speculative_tokens": K}) as llm:
        pid = llm.worker_pids[victim]
        got = _stream(llm, prompts, SamplingParams(max_tokens=24, ignore_eos=True), None, 0, deadline_s=90)
        stats = llm.stats()
    assert not alive(pid) and got == expected
    change, = stats["membership_changes"]
    assert change["lost"] == [victim] and stats["spec_decode"]["num_accepted_tokens"] > 0


def test_features_with_mtp_equal_the_outputs_without(mtp_checkpoint):
    """MTP drafts with n = 2 samples (forked: their shared prompt tail is copied to scratch before the chained
    passes), a small pool (preemption: recomputed sequences run their pass-1 rows again), repeated prompts (prefix
    cache hits), logprobs, stop tokens and chunked prefill: the outputs equal those without speculation."""
    prompts = _prompts()[:3] * 2
    cases = [SamplingParams(max_tokens=12, n=2, logprobs=2, ignore_eos=True),
             SamplingParams(max_tokens=14, stop_token_ids=[7, 11, 13], repetition_penalty=1.2)]
    runs, stats = [], None
    for cfg in (None, {"method": "mtp", "num_speculative_tokens": K}):
        with LLM(mtp_checkpoint, attention_ranks=1, expert_ranks=1, num_kv_blocks=10, block_size=4,
                 max_num_batched_tokens=16, max_num_seqs=6, speculative_config=cfg) as llm:
            runs.append([llm.generate(prompts, p) for p in cases])
            stats = llm.stats()
    assert stats["spec_decode"]["num_draft_tokens"] > 0 and stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert_same_outputs(*runs)
