"""PD on AF (prefill_ranks): prefill ranks take every prompt in, decode ranks decode every request after its
prefill, the two sharing the one expert pool; the tokens are transformers' greedy continuation in every
topology and comm mode, with prefix caching on and chunked prefill, and when a rank dies during a move."""
from __future__ import annotations

import os
import signal

import pytest
from conftest import FULL, hf_greedy, make_prompts, wider

from launch.llm import LLM, SamplingParams
from models.checkpoint import Checkpoint
from models.tiny import ARCHS

MAX_NEW = 10
BS = 4


def _prompts(n: int = 8, seed: int = 3) -> list[list[int]]:
    """Prompts of 2-30 tokens, two of them sharing a 13-token prefix with a third (prefix-cache hits)."""
    prompts = make_prompts(n, 256, 2, 30, seed=seed)
    prompts += [prompts[-1][:13] + [7, 8, 9], prompts[-1][:13] + [9, 8]]
    return prompts


def _run(path: str, prompts, attention: int, prefill: int, experts: int, **options) -> tuple[list, dict]:
    with LLM(path, attention_ranks=attention, expert_ranks=experts, prefill_ranks=prefill, block_size=BS,
             max_num_batched_tokens=12, enable_prefix_caching=True, **options) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        return [o.token_ids for o in outs], llm.stats()


CORE = [("qwen3_moe", 2, 1, 1, "direct"), ("deepseek_v3", 3, 1, 2, "two_phase"), ("olmoe", 3, 2, 1, "direct")]
# make test-full: every architecture at 1P+1D, 1P+2D and 2P+1D, each with direct and two_phase
WIDER = [(a, A, P, E, c) for a in ARCHS for A, P, E in ((2, 1, 1), (3, 1, 2), (3, 2, 1))
         for c in ("direct", "two_phase") if (a, A, P, E, c) not in CORE]


@pytest.mark.parametrize("arch,attention,prefill,experts,comm", CORE + [wider(*case) for case in WIDER])
def test_pd_tokens_equal_transformers(tiny_checkpoint, arch, attention, prefill, experts, comm):
    """Every request is prefilled on a prefill rank (chunked: a 12-token budget) and moves with its KV to a decode
    rank, which computes no prompt token; the tokens are transformers'. Each request moved once, with its
    blocks (a block that requests moved together share goes once, one its decode rank caches not at all); the
    prefix cache hits on the prefill ranks."""
    path = tiny_checkpoint(arch)
    prompts = _prompts()
    got, stats = _run(path, prompts, attention, prefill, experts, comm=comm,
                      ranks_per_node=2 if comm == "two_phase" else None)
    assert got == hf_greedy(path, prompts, MAX_NEW)
    pd = stats["pd"]
    assert pd["prefill_ranks"] == prefill and pd["requests_transferred"] == len(prompts)
    # the last two share the prefix blocks of prompts[-3]: moved in one message, such blocks go once, and a decode
    # rank that caches them already takes them from its cache (kv_blocks_reused) instead
    moved = pd["kv_blocks_transferred"] + pd["kv_blocks_reused"]
    assert sum(-(-len(p) // BS) for p in prompts[:-2]) <= moved <= sum(-(-len(p) // BS) for p in prompts)
    layers = Checkpoint(path).spec.num_layers
    block_bytes = BS * stats["kv_bytes_per_token_per_layer"] * layers
    assert pd["kv_bytes_transferred"] == pd["kv_blocks_transferred"] * block_bytes
    assert 0 < sum(pd["kv_transfer_buckets"]) <= len(prompts) and pd["kv_transfer_seconds"] > 0
    computed = pd["prompt_tokens_computed"]
    assert all(computed[:prefill]) and not any(computed[prefill:]), computed   # decode ranks run no prompt
    assert stats["prefix_cache_hits"] > 0 and stats["num_prefill_chunks"] > 0


def test_requests_wait_at_the_prefill_rank_for_a_decode_seat(tiny_checkpoint):
    """max_num_seqs=2: the one decode rank holds two requests at a time, so the others wait at the prefill rank
    with their blocks (never recomputed: the prompt tokens computed are exactly the prompts' own), and every
    output is still transformers'."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(6, 256, 3, 11, seed=5)
    got, stats = _run(path, prompts, 2, 1, 1, max_num_seqs=2)
    assert got == hf_greedy(path, prompts, MAX_NEW)
    assert stats["pd"]["requests_transferred"] == len(prompts) and stats["num_preemptions"] == 0
    assert stats["prompt_tokens_computed"] == sum(map(len, prompts))


@pytest.mark.parametrize("attention,prefill,experts", [(2, 1, 1), wider(3, 1, 2)])
def test_streamed_kv_goes_ahead_of_the_move(tiny_checkpoint, attention, prefill, experts):
    """Prompts of 40-60 tokens through a 12-token budget: each prefill takes several chunks. Streamed (the
    default), each chunk's full blocks go to the request's decode rank as they complete and its move sends only
    the rest: fewer blocks at the moves than stop-and-copy sends, every block sent once either way (streamed +
    at the moves = stop-and-copy's), and the same tokens as transformers."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(3, 256, 40, 60, seed=11)
    expected = hf_greedy(path, prompts, MAX_NEW)
    streamed, on = _run(path, prompts, attention, prefill, experts)
    whole, off = _run(path, prompts, attention, prefill, experts, stream_kv=False)
    assert streamed == whole == expected
    on, off = on["pd"], off["pd"]
    assert off["kv_blocks_streamed"] == 0 and on["kv_blocks_streamed"] > 0
    assert on["kv_blocks_transferred"] < off["kv_blocks_transferred"]
    assert on["kv_blocks_streamed"] + on["kv_blocks_transferred"] == off["kv_blocks_transferred"]
    assert on["kv_bytes_streamed"] * off["kv_blocks_transferred"] == \
        on["kv_blocks_streamed"] * off["kv_bytes_transferred"]
    assert on["requests_transferred"] == off["requests_transferred"] == len(prompts)


def test_pd_is_refused_without_a_decode_rank_and_with_a_stateful_draft(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match=r"prefill_ranks=2 with attention_ranks=2 leaves no decode rank"):
        LLM(path, attention_ranks=2, expert_ranks=1, prefill_ranks=2)
    with pytest.raises(ValueError, match=r"prefill_ranks=-1 is invalid"):
        LLM(path, attention_ranks=2, expert_ranks=1, prefill_ranks=-1)
    with pytest.raises(ValueError, match=r"prefill_ranks=1 with speculative method 'mtp': its draft KV"):
        LLM(path, attention_ranks=2, expert_ranks=1, prefill_ranks=1,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative method 'draft_model'"):
        LLM(path, attention_ranks=2, expert_ranks=1, prefill_ranks=1,
            speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})


def test_pd_with_ngram_speculation_equals_transformers(tiny_checkpoint):
    """1 prefill + 2 decode ranks with n-gram drafts (stateless: a request's drafts come from its tokens, which
    move with it): prompts that repeat themselves, so drafts are accepted on the decode ranks; every token is
    transformers' greedy one."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = [p * 3 for p in make_prompts(8, 256, 3, 10, seed=3)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    got, stats = _run(path, prompts, 3, 1, 1, speculative_config=ngram)
    assert got == hf_greedy(path, prompts, MAX_NEW)
    assert stats["pd"]["requests_transferred"] == len(prompts)
    assert stats["spec_decode"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("fault,victim", [("pd_move:1:2,pd_move:1:3,pd_move:1:4", 1),
                                          wider("before_report:2:4", 2)])
def test_a_rank_lost_during_pd_costs_no_request(tiny_checkpoint, monkeypatch, fault, victim):
    """2 prefill + 1 decode + 1 expert rank. pd_move: prefill rank 1 dies half way through its first move (step
    2, 3 or 4, as the requests arrive: it dropped the requests and sent their description, not their KV); the
    leader asks the ranks what they hold, finds those requests nowhere and queues them again. before_report: in
    1 prefill + 2 decode ranks, decode rank 2 dies after step 4's forward; its requests are prefilled again and
    move to the other decode rank.
    Every output is transformers' greedy continuation, within a watchdog."""
    from tests.dist_utils import alive
    from tests.launch.runtime.test_elastic import _stream
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(8, 256, 3, 11, seed=7)
    expected = hf_greedy(path, prompts, 16)
    monkeypatch.setenv("AFSERVE_FAULT", fault)
    prefill = 2 if victim == 1 else 1
    with LLM(path, attention_ranks=3, expert_ranks=1, prefill_ranks=prefill, block_size=BS) as llm:
        pid = llm.worker_pids[victim]
        got = _stream(llm, prompts, SamplingParams(max_tokens=16, ignore_eos=True), None, 0, deadline_s=90)
        stats = llm.stats()
    assert not alive(pid) and got == expected
    change, = stats["membership_changes"]
    assert change["lost"] == [victim] and stats["pd"]["prefill_ranks"] == 1
    assert stats["num_moved_requests"] > 0


# A wider Qwen3-MoE (hidden 512) whose prompt tokens cost enough that a 512-token chunk takes a prefill rank several
# of a decode rank's passes (the tiny one's passes are mostly fixed costs, as long as a few hundred prompt tokens).
WIDE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_attention_heads=8, head_dim=64)


def _long_prompts() -> list[list[int]]:
    """Prompts of 250-400 tokens (up to 512 a step)."""
    return make_prompts(8, 256, 250, 400, seed=11)


def _warm_up(llm: LLM, path: str) -> None:
    """Short requests first, whose decode steps (without prefill work) give the leader a decode pass's time."""
    prompts = make_prompts(3, 256, 4, 8, seed=12)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert got == hf_greedy(path, prompts, 12)


@pytest.mark.parametrize("attention,prefill,experts,comm", [(2, 1, 1, "direct"), wider(3, 1, 2, "two_phase")])
def test_decode_passes_equal_transformers(tiny_checkpoint, attention, prefill, experts, comm):
    """After a few short requests, while the prefill rank prefills long prompts, the decode ranks run several
    forwards per step (the prefill rank's MoE layers spread over their rounds); the tokens are transformers', and
    the decode ranks compute no prompt token. With max_decode_passes=1 no step has more than one."""
    path = tiny_checkpoint("qwen3_moe", **WIDE)
    prompts = _long_prompts()
    expected = hf_greedy(path, prompts, 24)
    for max_passes in (8, 1):
        with LLM(path, attention_ranks=attention, expert_ranks=experts, prefill_ranks=prefill, block_size=BS,
                 max_num_batched_tokens=512, max_decode_passes=max_passes, comm=comm,
                 ranks_per_node=2 if comm == "two_phase" else None) as llm:
            _warm_up(llm, path)
            got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
            stats = llm.stats()
        assert got == expected, max_passes
        assert (stats["pd"]["multi_pass_steps"] > 0) == (max_passes > 1), stats["pd"]["multi_pass_steps"]
        assert not any(stats["pd"]["prompt_tokens_computed"][prefill:])


@FULL   # make test keeps its 30-minute budget (the passes' token test above stays there)
def test_an_expert_rank_lost_between_decode_passes_costs_no_request(tiny_checkpoint, monkeypatch):
    """1 prefill + 1 decode + 2 expert ranks: expert rank 3 dies before the second pass of the first step with
    several (the decode rank has committed that step's first pass, the prefill rank is half way through its
    forward). The job re-forms with one expert rank and re-sends the step: the decode rank joins the pass it
    committed with no tokens and runs the rest, the prefill rank runs its forward again. Every output is
    transformers', within a watchdog."""
    from tests.dist_utils import alive
    from tests.launch.runtime.test_elastic import _stream
    path = tiny_checkpoint("qwen3_moe", **WIDE)
    prompts = _long_prompts()
    expected = hf_greedy(path, prompts, 24)
    monkeypatch.setenv("AFSERVE_FAULT", "expert_pass:3:1")
    with LLM(path, attention_ranks=2, expert_ranks=2, prefill_ranks=1, block_size=BS,
             max_num_batched_tokens=512, max_decode_passes=8) as llm:
        pid = llm.worker_pids[3]
        _warm_up(llm, path)
        got = _stream(llm, prompts, SamplingParams(max_tokens=24, ignore_eos=True), None, 0, deadline_s=120)
        stats = llm.stats()
    assert not alive(pid) and got == expected
    change, = stats["membership_changes"]
    assert change["lost"] == [3] and stats["pd"]["multi_pass_steps"] > 0


@FULL   # make test: the prefill pool's test below scales both pools
def test_the_decode_pool_grows_and_shrinks_with_requests_in_flight(tiny_checkpoint):
    """1 prefill + 1 decode + 1 expert rank; mid-stream, LLM.scale(decode_ranks=2) adds a decode rank (rank 2:
    the prefill ranks are the first prefill_ranks), which takes moved requests over in the next run; then,
    mid-stream again, decode_ranks=1 retires it: it hands its requests over with their KV to the other decode
    rank (a rank of its role). Every output is transformers'."""
    from tests.launch.runtime.test_elastic import _stream_scaling
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(8, 256, 3, 11, seed=9)
    expected = hf_greedy(path, prompts, 24)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM(path, attention_ranks=2, expert_ranks=1, prefill_ranks=1, block_size=BS) as llm:
        grown, answer = _stream_scaling(llm, prompts, params, {"decode_ranks": 2}, after_tokens=20)
        assert "error" not in answer and answer["attention_ranks"] == 3, answer
        mid = llm.stats()
        again = [o.token_ids for o in llm.generate(prompts, params)]     # the new decode rank takes some over
        taken = llm.stats()["pd"]["requests_taken_over"]
        shrunk, answer = _stream_scaling(llm, prompts, params, {"decode_ranks": 1}, after_tokens=40)
        assert "error" not in answer and answer["attention_ranks"] == 2, answer
        end = llm.stats()
    assert grown == again == shrunk == expected
    assert taken[0] == 0 and taken[1] > 0 and taken[2] > 0, taken
    assert mid["pool_ranks"] == {"attention": 3, "expert": 1, "prefill": 1, "decode": 2}
    assert end["pool_ranks"] == {"attention": 2, "expert": 1, "prefill": 1, "decode": 1}
    assert end["pd"]["requests_transferred"] >= 2 * len(prompts)


@FULL   # ~19 s: make test-full
def test_the_prefill_pool_grows_and_shrinks_and_pd_comes_back(tiny_checkpoint):
    """1 prefill + 1 decode + 1 expert rank. Mid-stream, LLM.scale(prefill_ranks=2) spawns a rank that joins as
    a prefill rank (rank 1: roles are positional, so the decode rank becomes rank 2), and the next prompts are
    prefilled on both prefill ranks, never on the decode rank. Mid-stream again, prefill_ranks=1 retires it (a
    prefill rank takes its requests over: two decode seats, so prefilled requests wait there). The decode rank
    then dies, which leaves the job colocated (prefill_ranks 0); scale(decode_ranks=1) brings PD back, the kept
    rank a prefill rank again (the leader, which saw the loss, names the rank to spawn). Every output is
    transformers'."""
    from tests.launch.runtime.test_elastic import _stream_scaling
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(8, 256, 3, 11, seed=9)
    expected = hf_greedy(path, prompts, 24)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM(path, attention_ranks=2, expert_ranks=1, prefill_ranks=1, block_size=BS, max_num_seqs=2) as llm:
        grown, answer = _stream_scaling(llm, prompts, params, {"prefill_ranks": 2}, after_tokens=20)
        assert "error" not in answer and (answer["attention_ranks"], answer["prefill_ranks"]) == (3, 2), answer
        before = llm.stats()["pd"]["prompt_tokens_computed"]
        again = [o.token_ids for o in llm.generate(prompts, params)]
        mid = llm.stats()
        shrunk, answer = _stream_scaling(llm, prompts, params, {"prefill_ranks": 1}, after_tokens=20)
        assert "error" not in answer and (answer["attention_ranks"], answer["prefill_ranks"]) == (2, 1), answer
        handed = llm.stats()["num_handed_over_requests"]
        os.kill(llm.worker_pids[1], signal.SIGKILL)     # the decode rank (member 1) dies: no decode rank is left
        alone = [o.token_ids for o in llm.generate(prompts[:2], params)]
        colocated = llm.stats()["membership_changes"][-1]
        back = llm.scale(decode_ranks=1)
        moved = llm.stats()["pd"]["requests_transferred"]
        last = [o.token_ids for o in llm.generate(prompts, params)]
        end = llm.stats()
    assert grown == again == shrunk == last == expected and alone == expected[:2]
    computed = [now - was for now, was in zip(mid["pd"]["prompt_tokens_computed"], before)]
    assert computed[0] > 0 and computed[1] > 0 and computed[2] == 0, computed
    taken = mid["pd"]["requests_taken_over"]    # the joiner (rank 1) prefills; the decode rank it pushed on decodes
    assert taken[1] == 0 and taken[2] >= 2 * len(prompts), taken
    assert mid["pool_ranks"] == {"attention": 3, "expert": 1, "prefill": 2, "decode": 1}
    assert handed > 0
    assert (colocated["attention_ranks"], colocated["prefill_ranks"]) == (1, 0)
    assert (back["attention_ranks"], back["prefill_ranks"]) == (2, 1)
    assert end["pool_ranks"] == {"attention": 2, "expert": 1, "prefill": 1, "decode": 1}
    assert end["pd"]["requests_transferred"] - moved == len(prompts)


def test_features_with_pd_equal_the_outputs_without(tiny_checkpoint):
    """PD (1 prefill + 2 decode) against one colocated attention rank, same expert pool, same per-rank limits:
    n = 2 samples (forked at the prefill rank, moved together with their shared blocks), seeded sampling (the
    generator's state moves with the request), logprobs and prompt logprobs (scored at the prefill rank), stop
    tokens, penalties, min_tokens, a small pool (preemption on the decode ranks, recomputed there) and chunked
    prefill: every sample's tokens, finish reason and logprobs are the same."""
    from tests.launch.test_speculative import assert_same_outputs
    path = tiny_checkpoint("qwen3_moe")
    prompts = make_prompts(6, 256, 5, 26, seed=13)
    cases = [SamplingParams(max_tokens=12, n=2, logprobs=2, ignore_eos=True, prompt_logprobs=1),
             SamplingParams(max_tokens=14, stop_token_ids=[7, 11, 13], repetition_penalty=1.2, min_tokens=3),
             SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)]
    runs, stats = [], []
    for attention, prefill in ((1, 0), (3, 1)):
        with LLM(path, attention_ranks=attention, expert_ranks=1, prefill_ranks=prefill, num_kv_blocks=12,
                 block_size=BS, max_num_batched_tokens=16, max_num_seqs=6) as llm:
            runs.append([llm.generate(prompts, p) for p in cases])
            stats.append(llm.stats())
    assert stats[1]["pd"]["requests_transferred"] > 0 and stats[1]["num_preemptions"] > 0
    assert_same_outputs(*runs)
    for a, b in zip(runs[0][0], runs[1][0]):     # the prompt logprobs too (batches differ: within 1e-4)
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) and a.prompt_logprobs[0] is b.prompt_logprobs[0] is None
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert ea.keys() == eb.keys() and all(abs(ea[t] - eb[t]) < 1e-4 for t in ea)
