"""PD decode passes (attention_nodes/passes.py): a prefill rank's stretched forward joins every round of a step of
several decode passes, in the order the expert ranks serve them, with each of its MoE layers in one round of its
own layer, spread over the passes; the leader sizes the passes from the ranks' measured step times; a step's pass
reports merge into one."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from attention_nodes.block_pool import BlockPool
from attention_nodes.leader import Leader
from attention_nodes.passes import PassPlanner, StretchedMoE, merge_reports, step_shape
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence
from comm.control import StepReport

H, K = 8, 2


class RecordingMoE:
    """Stands in for a MoEContext: records each round it joins (layer, rows), as the expert ranks see them."""

    def __init__(self):
        self.rounds: list[tuple[int, int]] = []
        self.waited_s = 0.0
        self.dispatcher = SimpleNamespace(stats=SimpleNamespace(now=lambda: 0.0))

    def start(self, layer, x, ids, weights):
        self.rounds.append((layer, x.shape[0]))
        return x

    def finish(self, pending, timed=True):
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


def test_the_empty_rounds_are_joined_while_the_next_layer_computes():
    """Once a layer's combine is back, the rounds before the next layer's are joined without the forward calling
    anything more (a helper thread): the decode ranks' passes need not wait for the prefill's next layer."""
    inner = RecordingMoE()
    moe = StretchedMoE(inner, 4, 4)                # layer l in pass l: rounds 0, 5, 10, 15
    x = torch.ones(2, H)
    moe.finish(moe.start(0, x, torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K)))
    deadline = time.monotonic() + 10
    while len(inner.rounds) < 5 and time.monotonic() < deadline:     # the "attention" of layer 1 runs here
        time.sleep(0.001)
    assert inner.rounds == [(0, 2), (1, 0), (2, 0), (3, 0), (0, 0)]
    moe.finish(moe.start(1, x, torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K)))
    assert inner.rounds[5] == (1, 2)
    moe.close()


def test_a_lost_peer_in_the_background_joins_reaches_the_forward():
    """The rounds between two of the prefill's layers are joined on a helper thread: a peer lost there (the data
    plane raising) raises in the forward, at its next dispatch."""
    class Failing(RecordingMoE):
        def start(self, layer, x, ids, weights):
            if len(self.rounds) == 3:
                raise RuntimeError("peer lost")
            return super().start(layer, x, ids, weights)

    moe = StretchedMoE(Failing(), 4, 4)            # layer l in pass l: rounds 0, 5, 10, 15
    x = torch.ones(2, H)
    moe.finish(moe.start(0, x, torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K)))
    with pytest.raises(RuntimeError, match="peer lost"):
        moe.start(1, x, torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K))
    assert moe.moe.rounds == [(0, 2), (1, 0), (2, 0)]


def test_merged_pass_reports_carry_every_pass_outputs_and_the_last_state():
    a = StepReport(1, 10, 2, 0, 2, outputs=[["r1", [5], None, None, None, 0]], cache_added=[1, 3], cache_evicted=[4],
                   wall_s=1, busy_s=0.5)
    b = StepReport(1, 9, 1, 0, 1, num_preemptions=3, outputs=[["r1", [6], "length", None, None, 0]],
                   cache_added=[2, 4], cache_evicted=[1, 7], wall_s=0.5, busy_s=0.25)
    m = merge_reports([a, b])
    assert [o[1] for o in m.outputs] == [[5], [6]] and m.outputs[1][2] == "length"
    # the leader applies evictions, then additions: 1 (added, then evicted) is gone, 4 (evicted, added) is back
    cached = {1, 4, 9}
    cached.difference_update(m.cache_evicted)
    cached.update(m.cache_added)
    assert cached == {2, 3, 4, 9}
    assert (m.num_free_blocks, m.num_running, m.num_preemptions) == (9, 1, 3)
    assert m.wall_s == 1.5 and m.busy_s == 0.75 and m.passes == 2
    assert merge_reports([a]) is a


def _reports(prefill_tokens: list[int], busy: list[float], wall: list[float], running: list[int],
             passes: list[int]) -> list[StepReport]:
    return [StepReport(i, 100, running[i], 0, prompt_tokens_computed=prefill_tokens[i], busy_s=busy[i],
                       wall_s=wall[i], passes=passes[i]) for i in range(len(wall))]


def test_the_planner_sizes_the_passes_from_measured_times():
    planner = PassPlanner(8)
    planner.observe(_reports([0, 0], [0, 0], [0, 0], [0, 0], [1, 1]), 1)    # the first report: counts only
    assert planner.choose(512, True) == 1                                   # nothing measured yet
    # the prefill rank computed 400 prompt tokens, busy 40 ms (of a 90 ms step); the decode rank's pass waited
    # for it: not a pass's own time
    planner.observe(_reports([400, 0], [0.04, 0.004], [0.09, 0.09], [0, 3], [1, 1]), 1)
    assert planner.s_per_prompt_token == pytest.approx(1e-4) and planner.s_per_decode_pass is None
    assert planner.choose(400, True) == 1
    # a step without prefill work: a decode pass takes 10 ms
    planner.observe(_reports([400, 0], [0, 0.002], [0.001, 0.01], [0, 3], [1, 1]), 1)
    assert planner.s_per_decode_pass == pytest.approx(0.01)
    assert planner.choose(400, True) == 4          # 40 ms of prefill compute over 10 ms a pass
    assert planner.choose(10_000, True) == 8       # at most max_passes
    assert planner.choose(400, False) == planner.choose(0, True) == 1
    assert planner.num_multi_pass_steps == 2
    # a stretched prefill (report passes 0) still teaches the prompt tokens' cost, its waits left out: 400 tokens,
    # busy 80 ms; its decode passes do not teach a pass's time (they ran beside it)
    planner.observe(_reports([800, 0], [0.08, 0.01], [0.2, 0.2], [0, 3], [0, 4]), 1)
    assert planner.s_per_prompt_token == pytest.approx(0.7 * 1e-4 + 0.3 * 2e-4)
    assert planner.s_per_decode_pass == pytest.approx(0.01)
    planner.observe(_reports([800, 0], [0, 0.002], [0.001, 0.02], [0, 3], [1, 1]), 1)
    assert planner.s_per_decode_pass == pytest.approx(0.7 * 0.01 + 0.3 * 0.02)
    assert PassPlanner(1).choose(10_000, True) == 1


def test_a_step_with_several_passes_runs_one_micro_batch():
    planner = PassPlanner(8)
    planner.s_per_prompt_token, planner.s_per_decode_pass = 1e-4, 5e-3
    reports = _reports([0, 0], [0, 0], [0, 0], [0, 4], [1, 1])
    for r in reports:
        r.max_next_tokens = 4
    assert step_shape(reports, {0: 300}, 512, 1, planner, 2, 1) == (1, 6)
    assert step_shape(reports, {}, 512, 1, planner, 2, 1) == (2, 1)   # 4 prefill tokens: one pass
    assert step_shape(reports, {0: 300}, 512, 0, planner, 2, 1) == (2, 1)   # no PD


def _leader_with_a_prompt_to_prefill() -> Leader:
    """1 prefill + 1 decode rank, the decode rank running 2 sequences, a 40-token prompt pending; measured: 0.1 ms
    a prompt token, 1 ms a decode pass."""
    worker = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4),
                             report=lambda: StepReport(0, 100, 0, 0, num_blocks=100),
                             kv=SimpleNamespace(bytes_per_token=0))
    leader = Leader(worker, 2, block_size=4, prefill_ranks=1, max_decode_passes=8)
    leader.pass_planner.s_per_prompt_token, leader.pass_planner.s_per_decode_pass = 1e-4, 1e-3
    leader.reports[1].num_running = leader.reports[1].max_next_tokens = 2
    leader.pending.append({"id": "a", "prompt": list(range(40)), "params": {"max_tokens": 4}})
    return leader


def test_the_leader_names_the_passes_in_the_header():
    leader = _leader_with_a_prompt_to_prefill()
    step = leader.next_step({})
    # 40 tokens x 0.1 ms over 1 ms a pass; one micro-batch
    assert step.decode_passes == 4 and step.micro_batches == 1


def test_a_step_re_sent_without_decode_ranks_runs_one_pass():
    """Review finding: the decode rank is lost in a step of several passes; the re-formed job has no decode rank
    (prefill_ranks 0), so the re-sent header runs one pass (no surviving rank committed any decode pass), not
    the former prefill rank's k forwards."""
    leader = _leader_with_a_prompt_to_prefill()
    leader.inflight = leader.next_step({})
    assert leader.inflight.decode_passes == 4
    leader.regroup([0])
    assert leader.prefill_ranks == leader.inflight.prefill_ranks == 0 and leader.inflight.decode_passes == 1


def test_later_running_sequences_keep_their_token_when_drafts_fill_the_budget():
    """Review finding: a decode pass after a step's first schedules within the header's capacity; the oldest
    sequences' drafts must not take the later ones' tokens."""
    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [Sequence.from_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8), i) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    sched.update(sched.schedule(), [[5]] * 4, frozenset(), 64)      # prefilled: one token each
    for seq in seqs:
        seq.spec_tokens = [6, 7, 8]
    out = sched.schedule(4)
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1", "r2", "r3"]
    assert out.num_tokens == 4 and all(not s.drafts for s in out.scheduled)
