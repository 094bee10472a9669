"""The planner (launch/plan): the step model's arithmetic by hand, the simulation's step count and token timings for
workloads worked out by hand, the calibration fit recovering known costs, the calibration on the runtime, and the
command line."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import astuple

import pytest

from launch.local_server import ROOT
from launch.plan.__main__ import candidates, parse_range, search, workload
from launch.plan.calibrate import _busiest_expert, _delta, _totals, fit, fit_peers, measure_windows
from launch.plan.hardware import count_params, derive_costs, memory_limits
from launch.plan.model import Plan, RankWork, StepCosts, simulate, step_time
from models import SHIPPED_MODEL
from tests.conftest import FULL

COSTS = dict(a0=1.0, a_tok=0.1, a_ctx=0.01, e0=2.0, e_pair=0.05, c0=0.5, c_tok=0.02, l0=0.3, l_row=0.01,
             h0=4.0, h_seq=0.2, moe_layers=3, top_k=2)


def costs(**over) -> StepCosts:
    return StepCosts(**{**COSTS, **over})


def test_one_micro_batch_adds_attention_comm_and_experts_per_layer():
    """40 tokens reading 400 pairs, 40 logit rows and sequences, 1+1: a = 1 + 4 + 4 = 9, c = 0.5 + 0.8 = 1.3,
    e = 2 + 0.05 * 80 = 6; layer 16.3, x3 layers; tail 0.3 + 0.4; host 4 + 8."""
    t, attn, expert = astuple(step_time(costs(), Plan(1, 1, 1), [RankWork(40, 400, 40, 40)]))
    assert t == pytest.approx(3 * 16.3 + 0.7 + 12.0)
    assert attn == pytest.approx(3 * 9 + 0.7 + 12.0) and expert == pytest.approx(3 * 6)


def test_ping_pong_takes_the_busier_side_per_micro_batch_and_one_fill():
    """M=2 on the same work: per micro-batch a = 1 + 2 + 2 = 5, c = 0.5 + 0.4 = 0.9, e = 2 + 2 = 4; with all of c
    the round trip's wait the sides are a = 5 and c + e = 4.9: each layer 2 * 5, and one fill of 4.9 a step (the
    pipeline runs across layers); the tail runs per micro-batch (l0 twice). With the attention rank's own sending
    cd = 0.3 + 0.01 * 20 = 0.5 of c, its side is 5.5 and the other 0.4 + 4: 2 * 5.5 a layer and a fill of 4.4."""
    t, attn, expert = astuple(step_time(costs(), Plan(1, 1, 2), [RankWork(40, 400, 40, 40)]))
    assert t == pytest.approx(3 * 2 * 5 + 4.9 + 0.6 + 0.4 + 12.0)
    assert attn == pytest.approx(3 * 2 * 5 + 1.0 + 12.0) and expert == pytest.approx(3 * 2 * 4)
    sending = costs(cd0=0.3, cd_tok=0.01)
    assert step_time(sending, Plan(1, 1, 2), [RankWork(40, 400, 40, 40)]).seconds == \
        pytest.approx(3 * 2 * 5.5 + 4.4 + 0.6 + 0.4 + 12.0)
    # one micro-batch: the whole of c lies between the two sides either way
    assert step_time(sending, Plan(1, 1, 1), [RankWork(40, 400, 40, 40)]) == \
        step_time(costs(), Plan(1, 1, 1), [RankWork(40, 400, 40, 40)])
    # under 2 * micro_batch_min_tokens on the least busy rank the step is not split: as with M=1
    small = [RankWork(40, 400, 40, 40), RankWork(20, 100, 20, 20)]
    assert step_time(costs(), Plan(2, 1, 2), small) == step_time(costs(), Plan(2, 1, 1), small)
    # an idle rank does not count (it joins the exchanges empty): the step splits
    idle = [RankWork(40, 400, 40, 40), RankWork()]
    assert step_time(costs(), Plan(2, 1, 2), idle).seconds < step_time(costs(), Plan(2, 1, 1), idle).seconds


def test_more_expert_ranks_share_the_pairs_and_the_busiest_attention_rank_sets_the_pace():
    work = [RankWork(40, 400, 40, 40), RankWork(10, 50, 10, 10)]
    t, attn, expert = astuple(step_time(costs(), Plan(2, 2, 1), work))
    e = 2 + 0.05 * 50 * 2 / 2          # 50 tokens, top-2, over 2 expert ranks
    assert expert == pytest.approx(3 * e)
    assert t == pytest.approx(3 * (9 + 1.3 + e) + 0.7 + 12.0)


def test_each_rank_beyond_one_a_side_adds_its_peer_cost_to_the_exchange():
    """c_peer_e per expert rank beyond one (cd_peer_e of it the attention rank's sending), c_peer_a per attention
    rank beyond one. 1+3, M=1, 40 tokens: c = 0.5 + 0.8 + 2 * 0.25 = 1.8, e = 2 + 0.05 * 80 / 3 a layer. 3+1, each
    rank 40 tokens: c = 1.3 + 2 * 0.125 = 1.55, e = 2 + 0.05 * 240. M=2 on 1+2: the attention side a + cd =
    5 + (0.3 + 0.01 * 20 + 0.2) = 5.7, the expert side c - cd + e = (0.9 + 0.25 - 0.7) + 2 + 1 = 3.45."""
    peers = costs(c_peer_e=0.25, cd_peer_e=0.2, c_peer_a=0.125)
    one = [RankWork(40, 400, 40, 40)]
    e = 2 + 0.05 * 80 / 3
    assert step_time(peers, Plan(1, 3, 1), one).seconds == pytest.approx(3 * (9 + 1.8 + e) + 0.7 + 12.0)
    three = [RankWork(40, 400, 40, 40)] * 3
    assert step_time(peers, Plan(3, 1, 1), three).seconds == pytest.approx(3 * (9 + 1.55 + 14) + 0.7 + 12.0)
    ping = costs(c_peer_e=0.25, cd_peer_e=0.2, cd0=0.3, cd_tok=0.01)
    assert step_time(ping, Plan(1, 2, 2), one).seconds == pytest.approx(3 * 2 * 5.7 + 3.45 + 0.6 + 0.4 + 12.0)
    # 1+1 pays none of them
    assert step_time(peers, Plan(1, 1, 1), one) == step_time(costs(), Plan(1, 1, 1), one)


def _stats(expert_seconds: dict[str, float], calls: int) -> dict:
    """comm_stats() as the calibration reads it: attention rank 0 (one MoE layer), and expert ranks whose one
    layer's compute took the given seconds in `calls` calls."""
    attention = {"role": "attention", "compute": {"0": {"calls": calls, "time_s": 1.0},
                                                  "-1": {"calls": calls, "time_s": 0.5}},
                 "layers": {"0": {"dispatch": {"time_s": 0.2}, "combine": {"time_s": 2.0}}},
                 "steps": {"calls": calls, "time_s": 5.0}}
    experts = {k: {"role": "expert", "compute": {"0": {"calls": calls, "time_s": t}}}
               for k, t in expert_seconds.items()}
    return {"ranks": {"0": attention, **experts}}


def test_a_window_counts_the_busiest_expert_rank_over_the_window():
    """Two expert ranks: rank 1 leads at the start, rank 2 does more within the window; the window's expert
    compute (and calls) is rank 2's, what the attention rank waited on, not the first snapshot's leader."""
    before, after = _stats({"1": 10.0, "2": 4.0}, 100), _stats({"1": 11.0, "2": 7.0}, 110)
    d = _delta(_totals(before), _totals(after))
    assert _busiest_expert(d) == (10, pytest.approx(3.0))
    # twice, as a decode window takes it (the second generate's counters less the first's): the first generate
    # adds 1 s on each rank in 10 calls, the second 2 s on rank 1 and 5 s on rank 2 in 20: rank 2's 4 s, 10 calls
    s0, s1, s2 = _stats({"1": 10.0, "2": 4.0}, 100), _stats({"1": 11.0, "2": 5.0}, 110), \
        _stats({"1": 13.0, "2": 10.0}, 130)
    twice = _delta(_delta(_totals(s0), _totals(s1)), _delta(_totals(s1), _totals(s2)))
    assert _busiest_expert(twice) == (10, pytest.approx(4.0)) and twice["steps"] == 10
    with pytest.raises(ValueError, match="multiples of 2"):
        measure_windows(SHIPPED_MODEL, windows=((3, 16),), prefills=(), ranks=(2, 1))


def test_the_peer_fit_takes_what_windows_beyond_1_1_add_per_rank():
    """Windows of 1+2, 1+3, 2+1 and 3+1 engines made from known per-peer costs on top of the 1+1 line (c0 + c_tok * T
    at each window's tokens per attention rank): the fit gives them back; a window below the line gives 0."""
    c = costs(cd0=0.2, cd_tok=0.005)
    truth = {"c_peer_e": 0.4, "cd_peer_e": 0.3, "c_peer_a": 0.6}
    windows = []
    for A, E, T in ((1, 2, 32), (1, 3, 64), (1, 3, 32), (2, 1, 16), (3, 1, 16), (3, 1, 32)):
        windows.append({"attention_ranks": A, "expert_ranks": E, "tokens": T,
                        "c_s": c.c0 + c.c_tok * T + truth["c_peer_e"] * (E - 1) + truth["c_peer_a"] * (A - 1),
                        "d_s": c.cd0 + c.cd_tok * T + truth["cd_peer_e"] * (E - 1)})
    fit_peers(c, windows)
    for name, value in truth.items():
        assert getattr(c, name) == pytest.approx(value), name
    below = costs()
    fit_peers(below, [{"attention_ranks": 2, "expert_ranks": 1, "tokens": 8, "c_s": 0.1, "d_s": 0.0}])
    assert below.c_peer_a == 0.0 and below.c_peer_e == 0.0


def test_fewer_cores_than_ranks_cap_the_step_at_the_summed_busy_time():
    work = [RankWork(40, 400, 40, 40)]
    free = step_time(costs(), Plan(1, 3, 1), work).seconds
    capped, attn, expert = astuple(step_time(costs(cores=1), Plan(1, 3, 1), work))
    # the exchanges count as CPU work: c = 0.5 + 0.02 * 40 = 1.3 a layer, all of it on each expert rank's side
    # without a measured sending share (cd), 0.3 of it on the attention rank's with cd0 = 0.3
    assert capped == pytest.approx(attn + 3 * expert + 3 * 3 * 1.3) and capped > free
    split = step_time(costs(cores=1, cd0=0.3), Plan(1, 3, 1), work).seconds
    assert split == pytest.approx(attn + 3 * 0.3 + 3 * expert + 3 * 3 * 1.0)
    assert step_time(costs(cores=4), Plan(1, 3, 1), work).seconds == free


def test_one_request_prefills_in_chunks_then_decodes_a_token_a_step():
    """A 1000-token prompt through a 512-token budget: two prefill steps (the second samples the first token),
    then 4 decode steps for 5 tokens. Each step's time is the model's for that step's work."""
    c, plan = costs(), Plan(1, 1, 1)
    got = simulate(c, plan, [1000], [5])
    steps = [RankWork(512, 512 * 513 // 2, 0, 1), RankWork(488, 488 * 512 + 488 * 489 // 2, 1, 1)]
    steps += [RankWork(1, 1000 + g, 1, 1) for g in range(1, 5)]
    times = [step_time(c, plan, [w]).seconds for w in steps]
    assert got.steps == 6
    assert got.seconds == pytest.approx(sum(times))
    assert got.ttft_p50_ms == pytest.approx(1e3 * (times[0] + times[1]))
    assert got.tok_s == pytest.approx(5 / sum(times))
    assert got.tpot_p99_ms == pytest.approx(1e3 * max(times[2:]))


def test_arrivals_at_a_rate_wait_for_their_time():
    """Two one-token requests 100 s apart (a step here takes ~16 s): each runs alone in one step at its arrival,
    so the run ends 100 s plus a step after the start, and each TTFT is one step."""
    c, plan = costs(), Plan(1, 1, 1)
    one = step_time(c, plan, [RankWork(1, 1, 1, 1)]).seconds
    got = simulate(c, plan, [1, 1], [1, 1], rate=0.01)
    assert got.steps == 2 and got.seconds == pytest.approx(100.0 + one)
    assert got.ttft_p99_ms == pytest.approx(1e3 * one)
    with pytest.raises(ValueError, match="rate=0"):
        simulate(c, plan, [1], [1], rate=0)


def test_requests_beyond_max_num_seqs_wait_and_spread_over_attention_ranks():
    """Four one-token-prompt requests of 3 tokens with max_num_seqs=1 on 2 attention ranks: two run at a time,
    one per rank, so 2 x 3 steps."""
    got = simulate(costs(), Plan(2, 1, 1, max_num_seqs=1), [1] * 4, [3] * 4)
    assert got.steps == 6
    one_rank = simulate(costs(), Plan(1, 1, 1, max_num_seqs=1), [1] * 4, [3] * 4)
    assert one_rank.steps == 12
    with pytest.raises(RuntimeError, match="3 of 4 requests unfinished"):
        simulate(costs(), Plan(1, 1, 1, max_num_seqs=1), [1] * 4, [3] * 4, max_steps=3)


def test_the_fit_recovers_the_costs_that_made_the_windows():
    c = costs(cd0=0.2, cd_tok=0.005)
    windows = []
    # decode windows (a token per sequence) and prefill windows (n prompts of p tokens in one step)
    shapes = [(n, n, n * (p + 24)) for n, p in ((8, 16), (32, 16), (64, 16), (64, 384), (16, 384))]
    shapes += [(n, n * p, n * p * (p + 1) // 2) for n, p in ((4, 128), (8, 32))]
    for n, t, pairs in shapes:
        windows.append({"seqs": n, "tokens": t, "pairs": pairs, "a_s": c.a0 + c.a_tok * t + c.a_ctx * pairs,
                        "e_s": c.e0 + c.e_pair * t * 2, "c_s": c.c0 + c.c_tok * t, "d_s": c.cd0 + c.cd_tok * t,
                        "tail_s": c.l0 + c.l_row * n, "host_s": c.h0 + c.h_seq * n})
    got = fit(windows, 3, 2, math.inf, "test")
    for name in ("a0", "a_tok", "a_ctx", "e0", "e_pair", "c0", "c_tok", "l0", "l_row", "h0", "h_seq", "cd0",
                 "cd_tok"):
        assert getattr(got, name) == pytest.approx(getattr(c, name), rel=1e-6), name


def test_the_fit_keeps_every_cost_non_negative():
    windows = [{"seqs": n, "pairs": 10 * n, "a_s": 5.0 - 0.01 * n, "e_s": 1.0, "c_s": 0.1, "tail_s": 0.1,
                "host_s": 0.1} for n in (8, 16, 32)]
    got = fit(windows, 3, 2, math.inf, "test")
    assert min(got.a0, got.a_tok, got.a_ctx) >= 0


@FULL
def test_calibration_windows_on_the_runtime():
    """Two decode windows and a prefill window on the shipped model: each step's counters are positive, and the
    larger batch costs more per call on both pools (the counters moved with the work)."""
    small, large, prefill = measure_windows(SHIPPED_MODEL, windows=((4, 16), (48, 16)), m1=4, m2=16, passes=2,
                                            prefills=((4, 64),), device="cpu")
    assert small["steps"] == large["steps"] == 12 and small["passes"] == 2
    for w in (small, large, prefill):
        assert w["a_s"] > 0 and w["e_s"] > 0 and w["tail_s"] > 0 and w["host_s"] > 0
    assert large["a_s"] > small["a_s"] and large["e_s"] > small["e_s"]
    # the prefill window is one step of 4 x 64 tokens: more work per call than 48 decode tokens
    assert prefill["kind"] == "prefill" and prefill["tokens"] == 256 and prefill["steps"] == 1
    assert prefill["a_s"] > large["a_s"] and prefill["e_s"] > large["e_s"]
    # a peer window on 2+1 ranks: 8 sequences split 4 a rank, every step counted on the first attention rank
    peer, = measure_windows(SHIPPED_MODEL, windows=((8, 16),), m1=4, m2=16, passes=1, prefills=(), ranks=(2, 1),
                            device="cpu")
    assert (peer["attention_ranks"], peer["expert_ranks"], peer["tokens"], peer["steps"]) == (2, 1, 4, 12)
    assert peer["c_s"] > 0 and peer["d_s"] > 0 and peer["e_s"] > 0


def test_search_ranks_plans_meeting_the_slo_first():
    prompts, outputs = workload(32, (16, 64), (8, 32), "uniform")
    plans = candidates(4, [1, 2], [64])
    assert len(plans) == 6 and {(p.attention_ranks, p.expert_ranks) for p in plans} == {(1, 3), (2, 2), (3, 1)}
    rows = search(costs(), plans, prompts, outputs, tpot_slo_ms=None)
    assert [r["tok_s"] for r in rows] == sorted((r["tok_s"] for r in rows), reverse=True)
    assert rows[0]["tok_s"] > rows[-1]["tok_s"]
    # an SLO between the plans' TPOTs: the fastest plan that meets it comes first, before a faster one that fails
    tight = min(rows, key=lambda r: r["tpot_p99_ms"])
    slo = tight["tpot_p99_ms"]
    ranked = search(costs(), plans, prompts, outputs, tpot_slo_ms=slo)
    meeting = [r for r in rows if r["tpot_p99_ms"] <= slo]
    assert ranked[0]["plan"] == max(meeting, key=lambda r: r["tok_s"])["plan"]
    assert [r["meets_slo"] for r in ranked] == [True] * len(meeting) + [False] * (len(rows) - len(meeting))


def test_bad_plans_costs_and_profiles_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="plan expert_ranks=0"):
        Plan(1, 0)
    with pytest.raises(ValueError, match="plan comm='auto'"):
        Plan(1, 1, comm="auto")
    with pytest.raises(ValueError, match="max_num_seqs=600 > max_num_batched_tokens=512"):
        Plan(1, 1, max_num_seqs=600)
    with pytest.raises(ValueError, match="step cost e_pair=-1"):
        costs(e_pair=-1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"a0": 1}')
    with pytest.raises(ValueError, match="step-cost profile .*bad.json"):
        StepCosts.load(str(bad))


def test_bad_lengths_and_shapes_are_refused_by_name():
    assert parse_range("16:256") == (16, 256) and parse_range("7") == (7, 7)
    for bad in ("0:5", "9:3", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match=f"length range '{bad}'"):
            parse_range(bad)
    with pytest.raises(ValueError, match="output shape 'zipf'"):
        workload(4, (1, 2), (1, 2), "zipf")


def test_the_command_line_plans_from_a_saved_profile(tmp_path):
    profile, out = tmp_path / "costs.json", tmp_path / "plans.json"
    costs(cores=2.0).save(str(profile))
    done = subprocess.run([sys.executable, "-m", "launch.plan", "--profile", str(profile), "--ranks", "3",
                           "--requests", "24", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1A+2E mb1 direct" in done.stdout and "2A+1E mb2 direct" in done.stdout
    plans = json.loads(out.read_text())["plans"]
    assert len(plans) == 4 and plans[0]["tok_s"] == max(p["tok_s"] for p in plans)
    bad = subprocess.run([sys.executable, "-m", "launch.plan", "--profile", str(profile), "--ranks", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ranks 1" in bad.stderr


@FULL
def test_plan_validation_bench_smoke():
    done = subprocess.run([sys.executable, "bench/plan_validation.py", "--smoke"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "predicted" in done.stdout and "planner's first choice" in done.stdout


def test_parameters_are_counted_by_pool_from_the_config_alone(tiny_checkpoint):
    """A tiny Qwen3-MoE checkpoint's config, counted on the meta device, against its weights' own tensors: the
    routed experts go to the expert pool, the rest of the decoder layers to the attention pool."""
    from safetensors import safe_open
    from transformers import AutoConfig

    path = tiny_checkpoint("qwen3_moe")
    counts = count_params(AutoConfig.from_pretrained(path))
    experts = attention = 0
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        for name in f.keys():
            n = f.get_slice(name).get_shape()
            n = math.prod(n)
            if ".layers." in name:
                if ".experts." in name:
                    experts += n
                else:
                    attention += n
    L = counts.moe_layers
    assert counts.experts_per_moe_layer * L == experts and counts.attention_per_moe_layer * L == attention
    assert counts.expert_params * counts.num_experts == counts.experts_per_moe_layer
    # tied embeddings: the head is still read once per logit row
    tied = count_params(AutoConfig.from_pretrained(path, tie_word_embeddings=True))
    assert tied.tail == tied.embed == counts.embed > 0


def test_derived_costs_are_the_roofline_of_the_counts():
    from launch.plan.hardware import COMPUTE_EFFICIENCY, LAUNCH_S, MEMORY_EFFICIENCY, Hardware, ParamCounts
    hw = Hardware("x", hbm_bytes_s=1e12, flops_bf16=1e15, flops_fp8=2e15, memory_bytes=80e9, link_bytes_s=4e11,
                  nic_bytes_s=5e10, link_latency_s=2e-6, nic_latency_s=5e-6, source="test")
    counts = ParamCounts(attention_per_moe_layer=10**8, experts_per_moe_layer=64 * 10**7, expert_params=10**7,
                         tail=10**9, kv_entry_elems=512, moe_layers=10, num_experts=64, top_k=8, hidden=4096,
                         node_limit=4, num_layers=12, pair_flops=2 * 32 * 128 * 2)
    c = derive_costs(counts, hw, weight_bytes=1.0, kv_bytes=1.0)
    bw, flops = 1e12 * MEMORY_EFFICIENCY, 2e15 * COMPUTE_EFFICIENCY
    assert c.a0 == pytest.approx(1e8 / bw + LAUNCH_S) and c.a_tok == pytest.approx(2e8 / flops)
    assert c.e_all == pytest.approx(6.4e8 / bw) and c.e_pair == pytest.approx(2e7 / flops)
    assert c.c_tok == pytest.approx(4 * 4096 * 3 / 5e10)      # 4 nodes at most, FP8 out and bf16 back, over the NIC
    assert derive_costs(counts, hw, inter_node=False).c_tok == pytest.approx(8 * 4096 * 3 / 4e11)   # one per expert
    # 12 layers' KV read and attention FLOPs (bf16) over 10 MoE layers
    assert c.a_ctx == pytest.approx(12 / 10 * (512 / bw + 2 * 32 * 128 * 2 / (1e15 * COMPUTE_EFFICIENCY)))
    experts, seqs = memory_limits(counts, hw, 1.0, 1.0, context=1000)
    assert experts == math.ceil(6.4e9 / 72e9)
    assert seqs == int((72e9 - (1e9 + 1e9)) // (1000 * 512 * 12))     # the head (no embedding given)


def test_the_command_line_plans_deepseek_v3_on_h800_within_its_memory():
    """DeepSeek-V3 at FP8 needs 10 H800s for its routed experts (654 GB over 72 GB each): on 12 GPUs only 1 or 2
    can hold attention; on 8 the plan is refused with the numbers."""
    args = [sys.executable, "-m", "launch.plan", "--hardware", "h800", "--model", "deepseek-v3", "--decode-only",
            "--prompt-len", "1024", "--output-len", "16:16", "--requests", "64", "--micro-batches", "1"]
    done = subprocess.run(args + ["--ranks", "12"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "a prediction" in done.stdout
    assert re.search(r"^1A\+11E mb1", done.stdout, re.M) and re.search(r"^2A\+10E mb1", done.stdout, re.M)
    assert not re.search(r"^3A\+9E", done.stdout, re.M)
    bad = subprocess.run(args + ["--ranks", "8"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "needs 10 expert ranks" in bad.stderr


def test_attention_flops_per_pair_follow_the_attention_kind():
    """Per (query, key) pair and layer: GQA scores and values over every query head; DeepSeek-V3's absorbed MLA
    reads the 576-wide latent and rotary key and the 512-wide latent value for each of its 128 heads."""
    from launch.plan.hardware import model_config
    qwen = count_params(model_config("qwen3-235b-a22b"))
    assert qwen.pair_flops == 2 * 64 * 128 * 2
    dsv3 = count_params(model_config("deepseek-v3"))
    assert dsv3.pair_flops == 2 * 128 * (512 + 64 + 512) and dsv3.kv_entry_elems == 576


def test_the_colocated_decode_takes_the_largest_batch_within_the_tpot_and_the_memory():
    """hardware.colocated_decode (DeepSeek's published decode deployment, every GPU attention and experts): the
    batch it returns meets the TPOT and one more sequence would not, or memory holds no more; its step time is
    the sum the docstring gives (one pipeline fill a step), worked here by hand."""
    from launch.plan.hardware import HARDWARE, colocated_decode, model_config
    counts, hw = count_params(model_config("deepseek-v3")), HARDWARE["h800"]
    got = colocated_decode(counts, hw, 144, 4096, 0.050, 2, 32, 1.0, 2.0)
    assert got["slots_per_gpu"] == 2 and got["bound"] in ("tpot", "memory")
    costs = derive_costs(counts, hw, 1.0, 2.0, True)
    slot_s = 2 * counts.expert_params / (hw.hbm_bytes_s * 0.8)

    def by_hand(B):
        b = B / 2
        compute = costs.a0 + (costs.a_tok + costs.a_ctx * 4096) * b + slot_s + costs.e_pair * 8 * b + costs.e0
        comm = costs.c0 + costs.c_tok * b
        return costs.moe_layers * 2 * max(compute, comm) + min(compute, comm) + 2 * costs.l0 + costs.l_row * B
    B = got["seqs_per_gpu"]
    assert got["step_ms"] == pytest.approx(by_hand(B) * 1e3)
    assert by_hand(B) <= 0.050 and (by_hand(B + 1) > 0.050 or B == got["memory_seqs"])
    assert got["tok_s_per_gpu"] == pytest.approx(B / by_hand(B))
    with pytest.raises(ValueError, match="no batch fits"):
        colocated_decode(counts, hw, 144, 4096, 0.001, 2, 32)


def test_the_published_side_by_side_prints_both_settings(tmp_path):
    """bench/plan_published.py on a smaller search (32 GPUs, 64 requests): a row per published setting with the
    published figure, the colocated model's and the best AF plan's, each ratio theirs; the JSON has the same."""
    out = tmp_path / "pp.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "plan_published.py"), "--ranks", "32",
                           "--requests", "64", "--concurrency", "512", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^(DeepSeek's online service.*|Step-3's report.*?)\s+(\d+)\s+(\d+)\s+([\d.]+)x\s+(\d+)\s+"
                      r"([\d.]+)x$", done.stdout, re.M)
    assert [int(r[1]) for r in rows] == [1850, 2324], done.stdout
    for _, pub, colo, r1, af, r2 in rows:
        assert abs(int(colo) / int(pub) - float(r1)) < 0.01 and abs(int(af) / int(pub) - float(r2)) < 0.01
    saved = json.loads(out.read_text())
    assert saved["gpus"] == 32 and [r["published_tok_s_per_gpu"] for r in saved["rows"]] == [1850, 2324]
    assert all(r["af_best"]["plan"].startswith(tuple(f"{a}A+" for a in range(1, 32))) for r in saved["rows"])
