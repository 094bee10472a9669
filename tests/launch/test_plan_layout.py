"""The planner's comm modes, nodes and redundant experts (launch/plan/layout.py): dispatch and combine priced from
messages counted by hand, the expert imbalance of EPLB's placement worked out by hand, the Zipf load, and the
command line searching modes and redundant slots."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import astuple

import pytest

from comm.cost_model import CostModel, LinkCost
from launch.plan.layout import expert_imbalance, parse_expert_load
from launch.plan.model import Plan, RankWork, StepCosts, simulate, step_time

COSTS = dict(a0=1.0, a_tok=0.1, a_ctx=0.01, e0=2.0, e_pair=0.05, c0=0.5, c_tok=0.02, l0=0.3, l_row=0.01,
             h0=4.0, h_seq=0.2, moe_layers=3, top_k=2, num_experts=8, hidden=16, dtype_bytes=2)
# a network where only the message count matters: 1 s per message within a node, 10 s between nodes
LATENCY_ONLY = CostModel(LinkCost(1.0, 0.0), LinkCost(10.0, 0.0)).to_dict()


def costs(**over) -> StepCosts:
    return StepCosts(**{**COSTS, **over})


def test_a_plan_across_nodes_prices_each_modes_messages_on_the_network():
    """2 attention ranks on node 0, 1 expert rank on node 1, one micro-batch (a = 9, e = 2 + 0.05 * 80 * 2 = 10
    for 80 tokens top-2 on one rank). direct: both attention ranks send to the expert rank and it answers both,
    2 messages between nodes each way, received (then sent) by one rank: c = 20 + 20. two_phase: rank 1 hands
    its tokens to rank 0 within the node (1), rank 0 sends one message to the expert rank (10), and back
    (10, then 1): c = 22. On one node, direct keeps the calibrated same-host cost c0 + c_tok * T."""
    work = [RankWork(40, 400, 40, 40), RankWork(40, 400, 40, 40)]
    net = costs(network=LATENCY_ONLY)
    rest = 0.7 + 12.0                                          # the tail and the host work
    direct = step_time(net, Plan(2, 1, 1, "direct", ranks_per_node=2), work)
    two_phase = step_time(net, Plan(2, 1, 1, "two_phase", ranks_per_node=2), work)
    local = step_time(net, Plan(2, 1, 1, "direct"), work)
    assert direct.seconds == pytest.approx(3 * (9 + 40 + 10) + rest)
    assert two_phase.seconds == pytest.approx(3 * (9 + 22 + 10) + rest)
    assert local.seconds == pytest.approx(3 * (9 + 0.5 + 0.02 * 40 + 10) + rest)
    # two_phase on one node: the collective transport, all within the node (rank 1 via rank 0: 1 + 1, and back)
    one_node = step_time(net, Plan(2, 1, 1, "two_phase"), work)
    assert one_node.seconds == pytest.approx(3 * (9 + 4 + 10) + rest)
    # two micro-batches over the collective: both sides take part in the whole exchange, a' = 1 + 2 + 2 = 5 and
    # e' = 2 + 0.05 * 80 * 2 / 2 = 6: sides 5 + 22 and 22 + 6, 2 * 28 a layer and one fill of 27; l0 twice
    ping_pong = step_time(net, Plan(2, 1, 2, "two_phase", ranks_per_node=2), work)
    assert ping_pong.seconds == pytest.approx(3 * 2 * 28 + 27 + 1.0 + 12.0)


def test_a_step_that_admits_requests_pads_its_messages_to_the_token_budget():
    """The engine's header sets the capacity to the token budget when a step takes new requests. Bytes only
    between nodes (1 us a byte): direct 2+1 on 2 nodes, hidden 16 in bf16 and top-2, a dispatched row is 32 +
    8 * 2 = 48 bytes and each source sends capacity + 1 rows, a combined row 32 bytes: the expert rank takes in
    2 * 48 * (C + 1) and sends 2 * 32 * C; C = 40 tokens, or 512 when the step admits."""
    net = costs(network=CostModel(LinkCost(0.0, 0.0), LinkCost(0.0, 1e-6)).to_dict())
    work = [RankWork(40, 400, 40, 40), RankWork(40, 400, 40, 40)]
    plan = Plan(2, 1, 1, ranks_per_node=2)

    def comm(C):
        return 1e-6 * (2 * 48 * (C + 1) + 2 * 32 * C)
    gap = step_time(net, plan, work, admits=True).seconds - step_time(net, plan, work).seconds
    assert gap == pytest.approx(3 * (comm(512) - comm(40)))
    # the same-host inboxes send exact sizes: no difference there
    assert step_time(net, Plan(2, 1, 1), work, admits=True) == step_time(net, Plan(2, 1, 1), work)


def test_a_plan_the_network_must_price_is_refused_without_one():
    with pytest.raises(ValueError, match=r"2A\+1E mb1 direct 2x2 .*--network FILE"):
        simulate(costs(), Plan(2, 1, 1, ranks_per_node=2), [16], [4])
    with pytest.raises(ValueError, match="two_phase .*--network FILE"):
        simulate(costs(), Plan(1, 1, 1, "two_phase"), [16], [4])
    with pytest.raises(ValueError, match="plan ranks_per_node=-1"):
        Plan(1, 1, ranks_per_node=-1)
    with pytest.raises(ValueError, match="expert count, .*re-run --calibrate"):
        simulate(costs(num_experts=0), Plan(1, 2, 1, redundant_experts=2), [16], [4])


def test_eplb_placement_imbalance_worked_by_hand():
    """Loads 6, 2, 1, 1 on 2 ranks of 2 slots: heaviest first onto the lightest rank with room, 6 | 2, 1 | 1 ->
    ranks at 7 and 3, max/mean 1.4. With 2 redundant slots (3 a rank) the hot expert gets a second replica
    (3 + 3; at most one per rank) and the next hottest the other (1 + 1): 3 + 1 + 1 on both ranks, 1.0."""
    assert expert_imbalance([[6, 2, 1, 1]], 4, 2, 0) == pytest.approx(1.4)
    assert expert_imbalance([[6, 2, 1, 1]], 4, 2, 2) == pytest.approx(1.0)
    assert expert_imbalance(None, 4, 2, 0) == 1.0
    # over layers the factors average: a balanced layer beside the skewed one
    assert expert_imbalance([[6, 2, 1, 1], [1, 1, 1, 1]], 4, 2, 0) == pytest.approx(1.2)


def test_the_expert_compute_scales_with_the_imbalance_and_the_redundant_slots_weights():
    """e = e0 + e_all * (slots / experts) / E + e_pair * pairs / E * imbalance: 1+2 ranks, 40 tokens top-2,
    e_all 8, 8 experts and 4 redundant slots: 2 + 8 * 1.5 / 2 + 0.05 * 80 / 2 * 1.4 = 10.8 per layer."""
    work = [RankWork(40, 400, 40, 40)]
    _, _, expert = astuple(step_time(costs(e_all=8.0), Plan(1, 2, 1, redundant_experts=4), work, imbalance=1.4))
    assert expert == pytest.approx(3 * 10.8)
    skewed = simulate(costs(), Plan(1, 2, 1), [16] * 8, [8] * 8, expert_load=[[30, 1, 1, 1, 1, 1, 1, 1]])
    even = simulate(costs(), Plan(1, 2, 1), [16] * 8, [8] * 8)
    spread = simulate(costs(), Plan(1, 2, 1, redundant_experts=2), [16] * 8, [8] * 8,
                      expert_load=[[30, 1, 1, 1, 1, 1, 1, 1]])
    # one hot expert (30 of 37) on 2 ranks of 4 slots: 30 + 1 + 1 + 1 against 4, max/mean 33 / 18.5; 2 redundant
    # slots give it a second replica (15 + 15) and the next expert one (0.5 + 0.5): 18.5 on each rank, and the
    # plan then runs as with a balanced load (e_all = 0: the extra slots' weights cost nothing here)
    assert expert_imbalance([[30, 1, 1, 1, 1, 1, 1, 1]], 8, 2, 0) == pytest.approx(33 / 18.5)
    assert expert_imbalance([[30, 1, 1, 1, 1, 1, 1, 1]], 8, 2, 2) == pytest.approx(1.0)
    assert skewed.tok_s < spread.tok_s and spread.tok_s == pytest.approx(even.tok_s, rel=0.02)


def test_zipf_loads_are_shares_no_expert_above_one_over_top_k():
    assert parse_expert_load("zipf:0", 4, 2) == [[0.25] * 4]
    [shares] = parse_expert_load("zipf:3", 8, 2)
    assert sum(shares) == pytest.approx(1.0) and shares[0] == pytest.approx(0.5)
    assert shares == sorted(shares, reverse=True) and shares[1] < 0.5
    # the excess of the capped expert goes to the others in proportion: 2nd / 3rd as 3^3 / 2^3
    assert shares[1] / shares[2] == pytest.approx(27 / 8)
    for bad in ("zipf:-1", "zipf:x", "/nonexistent.json"):
        with pytest.raises(ValueError, match="--expert-load"):
            parse_expert_load(bad, 8, 2)


def test_expert_load_files_are_checked(tmp_path):
    good = tmp_path / "load.json"
    good.write_text(json.dumps([[4, 3, 2, 1], [1, 1, 1, 1]]))
    assert parse_expert_load(str(good), 4, 2) == [[4.0, 3.0, 2.0, 1.0], [1.0] * 4]
    for i, text in enumerate(('{"a": 1}', "[[1, 2, 3, 4], 3]", "[true, 1, 1, 1]", "[1, 1, 1, Infinity]",
                              "[1, 2, 3]", "[0, 0, 0, 0]", "7")):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"--expert-load '{bad}': give a list of 4 finite counts"):
            parse_expert_load(str(bad), 4, 2)


def test_the_command_line_searches_comm_modes_and_redundant_slots(tmp_path):
    profile, network, out = tmp_path / "costs.json", tmp_path / "net.json", tmp_path / "plans.json"
    costs(cores=4.0).save(str(profile))
    network.write_text(json.dumps(LATENCY_ONLY))
    base = [sys.executable, "-m", "launch.plan", "--profile", str(profile), "--ranks", "4", "--requests", "16",
            "--micro-batches", "1"]
    done = subprocess.run(base + ["--comm", "direct,two_phase", "--network", str(network), "--ranks-per-node", "2",
                                  "--redundant-experts", "0,4", "--expert-load", "zipf:1.2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plans = json.loads(out.read_text())["plans"]
    assert {(p["comm"], p["redundant_experts"]) for p in plans} == {(c, r) for c in ("direct", "two_phase")
                                                                   for r in (0, 4)}
    assert len(plans) == 3 * 2 * 2 and re.search(r"2A\+2E mb1 two_phase 2x2 \+4r", done.stdout)
    # a latency-bound network: two attention ranks on a node send one message between nodes with two_phase
    by = {p["plan"]: p["tok_s"] for p in plans}
    assert by["2A+2E mb1 two_phase 2x2"] > by["2A+2E mb1 direct 2x2"]
    bad = subprocess.run(base + ["--comm", "two_phase"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--network FILE" in bad.stderr
    bad = subprocess.run(base + ["--comm", "three_phase"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--comm 'three_phase'" in bad.stderr


def test_cluster_plans_price_two_phase_on_the_gpus_links():
    """DeepSeek-V3 on 16 H800s, 8 a node, --network links: both modes are priced for every split, and a lone
    attention rank, which direct makes send a capacity-padded message to each of 15 expert ranks (7 of them
    over the NIC), does better with two_phase's one message per node pair."""
    done = subprocess.run([sys.executable, "-m", "launch.plan", "--hardware", "h800", "--model", "deepseek-v3",
                           "--decode-only", "--prompt-len", "1024", "--output-len", "16:16", "--requests", "256",
                           "--concurrency", "256", "--micro-batches", "2", "--ranks", "16", "--comm",
                           "direct,two_phase", "--network", "links", "--top", "40"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {(a, mode): float(t) for a, mode, t in
            re.findall(r"^(\d+)A\+\d+E mb2 (\w+) 2x8\s+\d+\s+(\d+)", done.stdout, re.M)}
    splits = {a for a, _ in rows}
    assert len(splits) >= 2 and all((a, m) in rows for a in splits for m in ("direct", "two_phase"))
    assert rows["1", "two_phase"] > rows["1", "direct"]


def test_plans_with_more_expert_ranks_than_slots_are_left_out():
    """8 experts: 9 expert ranks need a redundant slot (the engine refuses an expert rank without one)."""
    from launch.plan.__main__ import candidates, search
    plans = candidates(10, [1], [16], redundant=(0, 2))
    rows = search(costs(), plans, [16] * 4, [4] * 4, None)
    got = {(r["expert_ranks"], r["redundant_experts"]) for r in rows}
    assert (9, 0) not in got and (9, 2) in got and (8, 0) in got
    with pytest.raises(ValueError, match="more expert ranks than the model's 2 experts"):
        search(costs(num_experts=2), [Plan(1, 3)], [16], [4], None)


def test_redundant_slots_need_expert_ranks_memory():
    """DeepSeek-V3's routed experts at FP8, ~654 GB, fill 10 H800s at 72 GB each; 64 redundant slots (a quarter
    more than 256 experts) take ~818 GB: 12."""
    from launch.plan.hardware import HARDWARE, count_params, memory_limits, model_config
    counts, hw = count_params(model_config("deepseek-v3")), HARDWARE["h800"]
    assert memory_limits(counts, hw, 1.0, 1.0, 4096)[0] == 10
    assert memory_limits(counts, hw, 1.0, 1.0, 4096, redundant_experts=64)[0] == 12


def test_colocated_decode_with_one_micro_batch_overlaps_nothing():
    from launch.plan.hardware import HARDWARE, colocated_decode, count_params, derive_costs, model_config
    counts, hw = count_params(model_config("deepseek-v3")), HARDWARE["h800"]
    got = colocated_decode(counts, hw, 144, 4096, 0.050, 1, 32, 1.0, 2.0)
    c = derive_costs(counts, hw, 1.0, 2.0, True)
    B = got["seqs_per_gpu"]
    slot_s = 2 * counts.expert_params / (hw.hbm_bytes_s * 0.8)
    compute = c.a0 + (c.a_tok + c.a_ctx * 4096) * B + slot_s + c.e_pair * 8 * B + c.e0
    comm = c.c0 + c.c_tok * B
    assert got["step_ms"] == pytest.approx(1e3 * (c.moe_layers * (compute + comm) + c.l0 + c.l_row * B))


def test_plan_validation_repredicts_a_saved_run(tmp_path):
    """bench/plan_validation.py --repredict: each saved round's costs predict again, beside its measured figure
    (two rounds: the medians of two values are their means)."""
    from bench.throughput import workload
    from models import SHIPPED_MODEL
    prompts, olens = workload(256, max_output=256, model=SHIPPED_MODEL)
    plens = [len(p) for p in prompts]
    rounds = [costs(cores=2.0), costs(cores=2.0, a0=2.0)]
    plan = Plan(1, 1, 1, max_num_seqs=64)
    pred = [simulate(c, plan, plens, olens).tok_s for c in rounds]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"rounds": [{"costs": c.to_dict(), "measured": {plan.label(): m}}
                                          for c, m in zip(rounds, (1.0, 3.0))]}))
    done = subprocess.run([sys.executable, "bench/plan_validation.py", "--plans", "1,1,1", "--repredict", str(run)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    error = (sum(pred) / 2) / 2.0 - 1
    assert f"error {100 * error:+.1f}%" in done.stdout and f"{pred[0]:.0f}, {pred[1]:.0f}" in done.stdout
