"""sync_audit=True: every rank reports its host syncs per decode step in comm_stats, and the attention rank's
include the sampler's one sanctioned read (comm.sync_audit.host_read)."""
from __future__ import annotations

import os

import pytest

from launch import LLM, SamplingParams
from launch.config import EngineConfig
from models import SHIPPED_MODEL

SHIPPED_DRAFT = os.path.join(os.path.dirname(SHIPPED_MODEL), "shakespeare-draft")

pytestmark = pytest.mark.skipif(not os.path.isdir(SHIPPED_MODEL), reason="models/shakespeare-moe is not built")

SAMPLER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "attention_nodes", "sampler.py")
MAX_NEW = 6


def host_read_sites() -> set[str]:
    """The sampler's host_read calls, found in its source (not in the audit's own output)."""
    with open(SAMPLER) as f:
        return {f"attention_nodes/sampler.py:{n}" for n, line in enumerate(f, 1) if "host_read(" in line
                and not line.lstrip().startswith(("from ", "import "))}


def test_every_rank_reports_its_decode_step_syncs():
    prompts = ["ROMEO.\n", "Hamlet.\nTo be, or not to be,", "Enter"]
    with LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1, sync_audit=True) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        ranks = llm.comm_stats()["ranks"]
    assert all(len(o.token_ids) == MAX_NEW for o in outs)
    attention, expert = ranks["0"]["host_syncs"], ranks["1"]["host_syncs"]
    assert set(attention) == set(expert) == {"decode_steps", "max_per_decode_step", "sites"}
    # Prompts that reach the leader together prefill in the first step, and the other MAX_NEW - 1 steps decode
    # all of them; one that arrives a step later turns one decode step into a prefill step.
    assert 1 <= attention["decode_steps"] <= MAX_NEW - 1
    assert expert["decode_steps"] == attention["decode_steps"]     # the header's decode flag agrees
    (site,) = host_read_sites()
    assert attention["sites"][site] == attention["decode_steps"]    # one read of the sampled ids per step
    assert attention["max_per_decode_step"] >= 1
    assert all(n > 0 for n in attention["sites"].values())
    assert sum(attention["sites"].values()) <= attention["max_per_decode_step"] * attention["decode_steps"]
    assert not any(s.startswith("attention_nodes/sampler.py") for s in expert["sites"])


def test_no_report_without_the_option():
    with LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1) as llm:
        llm.generate(["Enter"], SamplingParams(max_tokens=2, ignore_eos=True))
        ranks = llm.comm_stats()["ranks"]
    assert [r["host_syncs"] for r in ranks.values()] == [None, None]


def test_sync_audit_must_be_a_bool():
    with pytest.raises(ValueError, match="sync_audit='yes'"):
        EngineConfig.from_options(SHIPPED_MODEL, 1, 1, sync_audit="yes")


@pytest.mark.parametrize("A,E,comm,balancer", [(1, 2, "direct", "static"), (1, 2, "direct", "least_loaded"),
                                               (2, 2, "two_phase", "least_loaded")])
def test_decode_steps_wait_on_the_host_once_on_attention_ranks_and_never_on_expert_ranks(A, E, comm, balancer):
    """The GPU property, proven on CPU: with the data plane a CUDA run uses (the collective transport, `direct`
    dispatch, or `two_phase` over two emulated nodes of 2 ranks) a decode step reads back only the sampled ids on
    attention ranks, and nothing on expert ranks, whatever the balancer (least_loaded with a replica to choose
    between)."""
    prompts = ["ROMEO.\n", "Hamlet.\nTo be, or not to be,", "Enter", "KING."]
    with LLM(SHIPPED_MODEL, attention_ranks=A, expert_ranks=E, sync_audit=True, transport="collective",
             comm=comm, balancer=balancer, redundant_experts=1, ranks_per_node=2) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        ranks = llm.comm_stats()["ranks"]
    (site,) = host_read_sites()
    for r in range(A):
        attention = ranks[str(r)]["host_syncs"]
        assert attention["decode_steps"] >= 1
        assert attention["max_per_decode_step"] == 1 and set(attention["sites"]) == {site}, attention
    for r in range(A, A + E):
        # with one attention rank its decode flag is every rank's (more leave idle ranks' steps ambiguous)
        assert ranks[str(r)]["host_syncs"]["decode_steps"] >= 1 if A > 1 else \
            ranks[str(r)]["host_syncs"]["decode_steps"] == ranks["0"]["host_syncs"]["decode_steps"]
        assert ranks[str(r)]["host_syncs"]["max_per_decode_step"] == 0, ranks[str(r)]["host_syncs"]


def test_the_same_host_transport_with_in_band_counts_reads_nothing_back_per_layer():
    """transport='shm' with two expert ranks carries each source's row count in its message (in_band_counts='on',
    the default with cuda_ipc on a GPU): a decode step reads back only the sampled ids on the attention rank and
    nothing on expert ranks, as with the collective transport."""
    prompts = ["ROMEO.\n", "Hamlet.\nTo be, or not to be,", "Enter", "KING."]
    with LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=2, sync_audit=True, transport="shm",
             in_band_counts="on", balancer="least_loaded", redundant_experts=1) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        ranks = llm.comm_stats()["ranks"]
    (site,) = host_read_sites()
    attention = ranks["0"]["host_syncs"]
    assert attention["decode_steps"] >= 1
    assert attention["max_per_decode_step"] == 1 and set(attention["sites"]) == {site}, attention
    for r in (1, 2):
        assert ranks[str(r)]["host_syncs"]["decode_steps"] == attention["decode_steps"]
        assert ranks[str(r)]["host_syncs"]["max_per_decode_step"] == 0, ranks[str(r)]["host_syncs"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_draft_steps_wait_on_the_host_once(method):
    """Speculative decoding's verification steps count as decode steps (one token per sequence plus its drafts)
    on every rank, and read back only the emitted tokens (attention_nodes/speculation.py's host_read) on the
    attention rank, nothing on the expert ranks. The draft model's drafts stay on the device: its forwards after
    the step read nothing."""
    spec = os.path.join(os.path.dirname(SAMPLER), "speculation.py")
    with open(spec) as f:
        (site,) = {f"attention_nodes/speculation.py:{n}" for n, line in enumerate(f, 1)
                   if "host_read(" in line and not line.lstrip().startswith(("from ", "import "))}
    config = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
              "draft_model": {"method": "draft_model", "model": SHIPPED_DRAFT, "num_speculative_tokens": 3}}[method]
    prompts = ["ROMEO.\nO Romeo, Romeo, O Romeo", "To be, or not to be, to be, or not"]
    with LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=2, sync_audit=True, transport="collective",
             speculative_config=config) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        ranks = llm.comm_stats()["ranks"]
        drafted = llm.stats()["spec_decode"]["num_draft_tokens"]
    attention = ranks["0"]["host_syncs"]
    assert drafted > 0 and attention["sites"].get(site, 0) >= 1, attention     # verification steps were audited
    assert attention["max_per_decode_step"] == 1, attention
    assert sum(attention["sites"].values()) == attention["decode_steps"], attention
    for r in ("1", "2"):
        assert ranks[r]["host_syncs"]["decode_steps"] == attention["decode_steps"]
        assert ranks[r]["host_syncs"]["max_per_decode_step"] == 0, ranks[r]["host_syncs"]
