"""PD decode passes (attention_nodes/passes.py): a prefill rank's stretched forward joins every round of a step of
several decode passes, in the order the expert ranks serve them, with each of its MoE layers in one round of its
own layer, spread over the passes; the leader sizes the passes from the ranks' measured step times; a step's pass
reports merge into one."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attention_nodes.leader import Leader
from attention_nodes.passes import PassPlanner, StretchedMoE, merge_reports, step_shape
from comm.control import StepReport

H, K = 8, 2


class RecordingMoE:
    """Stands in for a MoEContext: records each round it joins (layer, rows), as the expert ranks see them."""

    def __init__(self):
        self.rounds: list[tuple[int, int]] = []
        self.dispatcher = SimpleNamespace(stats=SimpleNamespace(now=lambda: 0.0))

    def start(self, layer, x, ids, weights):
        self.rounds.append((layer, x.shape[0]))
        return x

    def finish(self, pending):
        return pending


def _stretched_forward(num_layers: int, passes: int, tokens: int = 5) -> list[tuple[int, int]]:
    inner = RecordingMoE()
    moe = StretchedMoE(inner, num_layers, passes)
    for layer in range(num_layers):      # the forward: each MoE layer in turn, dispatch then combine
        x = torch.ones(tokens, H)
        moe.finish(moe.start(layer, x, torch.zeros(tokens, K, dtype=torch.int64), torch.ones(tokens, K)))
    moe.close()
    return inner.rounds


@pytest.mark.parametrize("num_layers,passes", [(4, 2), (4, 4), (3, 5), (6, 4), (1, 3), (5, 1)])
def test_a_stretched_forward_joins_every_round_of_the_passes_in_the_experts_order(num_layers, passes):
    rounds = _stretched_forward(num_layers, passes)
    # the expert ranks serve pass after pass, each the MoE layers in order (ExpertWorker.step)
    assert [layer for layer, _ in rounds] == [layer for _ in range(passes) for layer in range(num_layers)]
    real = [i for i, (_, rows) in enumerate(rounds) if rows]
    assert len(real) == num_layers and all(rows in (0, 5) for _, rows in rounds)
    # spread over the passes: the passes each carry as many of the prefill's layers, give or take one
    per_pass = [sum(1 for i in real if i // num_layers == p) for p in range(passes)]
    assert max(per_pass) - min(per_pass) <= 1, per_pass
    assert real[0] // num_layers == 0       # the prefill starts in the first pass


def test_merged_pass_reports_carry_every_pass_outputs_and_the_last_state():
    a = StepReport(1, 10, 2, 0, 2, outputs=[["r1", [5], None, None, None]], cache_added=[1], wall_s=1)
    b = StepReport(1, 9, 1, 0, 1, num_preemptions=3, outputs=[["r1", [6], "length", None, None]],
                   cache_added=[2], cache_evicted=[7], wall_s=0.5)
    m = merge_reports([a, b])
    assert [o[1] for o in m.outputs] == [[5], [6]] and m.outputs[1][2] == "length"
    assert m.cache_added == [1, 2] and m.cache_evicted == [7]
    assert (m.num_free_blocks, m.num_running, m.num_preemptions) == (9, 1, 3)
    assert m.wall_s == 1.5 and m.passes == 2
    assert merge_reports([a]) is a


def _reports(prefill_tokens: list[int], wall: list[float], running: list[int], passes: list[int]
             ) -> list[StepReport]:
    return [StepReport(i, 100, running[i], 0, prompt_tokens_computed=prefill_tokens[i], wall_s=wall[i],
                       passes=passes[i]) for i in range(len(wall))]


def test_the_planner_sizes_the_passes_from_measured_times():
    planner = PassPlanner(8)
    planner.observe(_reports([0, 0], [0, 0], [0, 0], [1, 1]), 1)       # the first report: counts only
    assert planner.choose(512, True) == 1                              # nothing measured yet
    # a step with prefill work before a decode pass was measured alone: nothing to learn from yet
    planner.observe(_reports([100, 0], [0.05, 0.05], [0, 3], [1, 1]), 1)
    assert planner.s_per_prompt_token is None and planner.s_per_decode_pass is None
    # a step without prefill work: a decode pass takes 10 ms
    planner.observe(_reports([100, 0], [0.001, 0.01], [0, 3], [1, 1]), 1)
    assert planner.s_per_decode_pass == pytest.approx(0.01) and planner.s_per_prompt_token is None
    assert planner.choose(400, True) == 1
    # a step of one pass in which the prefill rank computed 400 prompt tokens in 50 ms: 40 ms beyond a pass's
    planner.observe(_reports([500, 0], [0.05, 0.05], [0, 3], [1, 1]), 1)
    assert planner.s_per_prompt_token == pytest.approx(1e-4) and planner.s_per_decode_pass == pytest.approx(0.01)
    assert planner.choose(400, True) == 5          # the prefill's forward: 10 + 40 ms, as long as 5 passes
    assert planner.choose(100, True) == 2
    assert planner.choose(10_000, True) == 8       # at most max_passes
    assert planner.choose(400, False) == planner.choose(0, True) == 1
    assert planner.num_multi_pass_steps == 3
    # a step of several passes teaches neither (its passes wait for the prefill, its prefill for the passes), but
    # its passes' own wall time, 20 ms each beside the prefill (twice as long as alone), sizes the next steps
    planner.observe(_reports([900, 0], [0.1, 0.1], [0, 3], [0, 5]), 1)
    assert planner.s_per_prompt_token == pytest.approx(1e-4) and planner.s_per_decode_pass == pytest.approx(0.01)
    assert planner.s_per_shared_pass == pytest.approx(0.02)
    assert planner.choose(400, True) == 2          # 50 ms of prefill: 2.5 passes of 20 ms (rounded to even)
    # the next clean decode step and one-pass prefill step are averaged in
    planner.observe(_reports([900, 0], [0.001, 0.02], [0, 3], [1, 1]), 1)
    assert planner.s_per_decode_pass == pytest.approx(0.7 * 0.01 + 0.3 * 0.02)
    base = planner.s_per_decode_pass
    planner.observe(_reports([1100, 0], [base + 0.06, 0.07], [0, 3], [1, 1]), 1)     # 200 tokens, 60 ms beyond
    assert planner.s_per_prompt_token == pytest.approx(0.7 * 1e-4 + 0.3 * 3e-4)
    assert PassPlanner(1).choose(10_000, True) == 1


def test_a_step_with_several_passes_runs_one_micro_batch():
    planner = PassPlanner(8)
    planner.s_per_prompt_token, planner.s_per_decode_pass = 1e-4, 6e-3
    reports = _reports([0, 0], [0, 0], [0, 4], [1, 1])
    for r in reports:
        r.max_next_tokens = 4
    assert step_shape(reports, {0: 300}, 512, 1, planner, 2, 1) == (1, 6)
    assert step_shape(reports, {}, 512, 1, planner, 2, 1) == (2, 1)   # 4 prefill tokens: one pass
    assert step_shape(reports, {0: 300}, 512, 0, planner, 2, 1) == (2, 1)   # no PD


def test_the_leader_names_the_passes_in_the_header():
    worker = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4),
                             report=lambda: StepReport(0, 100, 0, 0, num_blocks=100),
                             kv=SimpleNamespace(bytes_per_token=0))
    leader = Leader(worker, 2, block_size=4, prefill_ranks=1, max_decode_passes=8)
    leader.pass_planner.s_per_prompt_token, leader.pass_planner.s_per_decode_pass = 1e-4, 1e-3
    leader.reports[1].num_running = leader.reports[1].max_next_tokens = 2
    leader.pending.append({"id": "a", "prompt": list(range(40)), "params": {"max_tokens": 4}})
    step = leader.next_step({})
    assert step[-1] == 5 and step[5] == 1          # 1 ms + 40 tokens x 0.1 ms: 5 passes of 1 ms; one micro-batch
