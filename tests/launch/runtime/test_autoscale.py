"""The A:E autoscaler (launch/runtime/autoscale.py): its decisions from hand-made step costs and reported work,
and, in an engine, a move between the pools with every output still transformers'."""
from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest

from launch import LLM, SamplingParams
from launch.plan.model import Plan, StepCosts
from launch.runtime.autoscale import Autoscaler
from models import SHIPPED_MODEL
from tests.conftest import hf_greedy, make_prompts


def _costs(**kw) -> StepCosts:
    base = dict(a0=0.0, a_tok=0.0, a_ctx=0.0, e0=0.0, e_pair=0.0, c0=0.0, c_tok=0.0, l0=0.0, l_row=0.0, h0=0.0,
                h_seq=0.0, moe_layers=1, top_k=1)
    return StepCosts(**{**base, **kw})


def _scaler(costs: StepCosts, window: int = 2, margin: float = 0.1, experts: int = 8, **plan):
    return Autoscaler(costs, Plan(1, 1, micro_batches=1, **plan), experts, window, margin)


def _feed(scaler: Autoscaler, pools: tuple[int, int], work: list[int], steps: int, pending: bool = False):
    """steps identical steps whose summed work is `work`, spread over the attention ranks, each rank busy 10 ms of
    a 20 ms step -> the requests."""
    A = pools[0]
    per = [[-(-x // A) for x in work]] * A
    return [r for _ in range(steps) if (r := scaler.observe(*pools, per, [0.01] * A, [0.02] * A, pending))]


def test_an_attention_bound_window_moves_ranks_to_the_attention_pool():
    """Attention costs 1 ms per token, experts nothing: the model halves the attention side's time on two attention
    ranks and leaves the rest. Measured: 10 ms busy of a 20 ms step, so 2+1 is predicted at 5 + 10 ms, 25% below:
    from 1+2 the budget of 3 goes to 2+1, asked once, after the dwell (a window) and one measured window."""
    scaler = _scaler(_costs(a_tok=1e-3))
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 3) == []        # 2 steps of dwell, 1 measured
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 1) == [{"attention_ranks": 2, "expert_ranks": 1,
                                                            "cause": "autoscale"}]
    d = scaler.decisions[-1]
    assert d["model_attention_s"] == pytest.approx(0.064) and d["predicted_s"] == pytest.approx(0.015)
    assert d["attention_util"] == pytest.approx(0.5) and d["step_s"] == pytest.approx(0.02) and d["moved"]
    assert scaler.budget == 3
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 8, pending=True) == []    # asked: nothing while it waits


def test_an_expert_bound_window_moves_ranks_to_the_expert_pool_within_the_experts():
    """Experts cost 1 ms per pair: the model quarters the expert side's time on four expert ranks. From 4+1 (budget
    5) the best split is 1+4 (10 + 2.5 ms); with only 3 experts in the model an expert pool has at most 3 ranks:
    2+3."""
    costs = _costs(e_pair=1e-3, top_k=2)
    assert _feed(_scaler(costs), (4, 1), [64, 0, 64, 64], 4)[-1]["expert_ranks"] == 4
    got = _feed(_scaler(costs, experts=3), (4, 1), [64, 0, 64, 64], 4)
    assert got == [{"attention_ranks": 2, "expert_ranks": 3, "cause": "autoscale"}]


def test_no_move_below_the_margin_or_away_from_the_best_split():
    """A fixed cost a0 per layer dominating: 2+1 is predicted under 10% faster than 1+2, so no move (recorded as
    not moved, best 2+1). From 2+1 itself the only other split, 1+2, is predicted slower: no move either."""
    scaler = _scaler(_costs(a0=1.0, a_tok=1e-3), margin=0.1)
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 8) == []
    assert scaler.decisions and not any(d["moved"] for d in scaler.decisions)
    assert scaler.decisions[-1]["best"] == [2, 1]
    best = _scaler(_costs(a_tok=1e-3))
    assert _feed(best, (2, 1), [64, 64, 64, 64], 8) == []
    assert best.decisions[-1]["predicted_s"] == pytest.approx(0.03) and not best.decisions[-1]["moved"]


def test_a_share_over_a_ranks_sequence_limit_is_priced_as_the_steps_it_needs():
    """max_num_seqs 32: 64 sequences on one attention rank take two steps of 32, so a fixed 1 ms per step costs
    2 ms there against 1 ms on each of two ranks."""
    scaler = _scaler(_costs(a0=1e-3), max_num_seqs=32)
    _feed(scaler, (2, 1), [64, 64, 64, 64], 3)
    assert scaler.model(1, 2)[0] == pytest.approx(2 * scaler.model(2, 1)[0])


def test_a_refused_move_is_asked_again_after_a_doubling_back_off_and_a_waiting_scale_holds_it():
    """The leader refused the move (its record's error): recorded with why; measured afresh after a window of
    back-off (2 steps), then two after a second refusal. Once the job changes (a user's scale to 1+3) the budget
    follows it and the back-off starts over. A request that ended without an error or a change counts as refused.
    While any scale request waits, nothing is measured."""
    scaler = _scaler(_costs(a_tok=1e-3))
    assert len(_feed(scaler, (1, 2), [64, 64, 64, 64], 4)) == 1
    scaler.refused("no GPU room")
    assert scaler.decisions[-1] == {"refused": [2, 1], "why": "no GPU room", "back_off_steps": 2}
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 3) == [] and len(_feed(scaler, (1, 2), [64, 64, 64, 64], 1)) == 1
    scaler.refused("no GPU room")
    assert scaler.decisions[-1]["back_off_steps"] == 4
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 5) == [] and len(_feed(scaler, (1, 2), [64, 64, 64, 64], 1)) == 1
    assert _feed(scaler, (1, 3), [64, 64, 64, 64], 4) == [{"attention_ranks": 3, "expert_ranks": 1,
                                                           "cause": "autoscale"}]
    assert scaler.budget == 4
    assert _feed(scaler, (1, 3), [0, 0, 0, 0], 1) == []      # no longer pending, the job the same: it ended
    assert scaler.decisions[-1]["refused"] == [3, 1] and scaler.decisions[-1]["back_off_steps"] == 2
    held = _scaler(_costs(a_tok=1e-3))
    assert _feed(held, (1, 2), [64, 64, 64, 64], 20, pending=True) == [] and held.decisions == []


def test_a_re_formed_job_of_the_same_sizes_is_a_change():
    """The move asked for went through and a user's scale put the sizes back before the next step: the job's
    generation changed, so that is a change (dwell and measure afresh), not a refusal."""
    scaler = _scaler(_costs(a_tok=1e-3))
    assert len(_feed(scaler, (1, 2), [64, 64, 64, 64], 4)) == 1
    per = [[64, 64, 64, 64]]
    assert scaler.observe(1, 2, per, [0.01], [0.02], False, generation=2) is None
    assert not any("refused" in d for d in scaler.decisions)


def test_a_stale_spawn_message_is_skipped():
    """The front starts the ranks of a ("spawn", roles, deadline) it reads with more than half the start-up timeout
    left, not those of one whose request is about to time out (they would join past it)."""
    llm = LLM.__new__(LLM)
    outbox, started = queue.Queue(), []
    llm._outbox, llm._spawn_joiner, llm.check_alive = outbox, started.append, lambda what: None
    llm.config = SimpleNamespace(startup_timeout_s=60.0)
    outbox.put(("spawn", ["expert"], time.monotonic() + 10))
    outbox.put(("spawn", ["attention"], time.monotonic() + 50))
    outbox.put(("out", []))
    assert llm._poll(outbox, None, "test") == ("out", []) and started == ["attention"]


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="autoscale_window=0"):
        _scaler(_costs(), window=0)
    with pytest.raises(ValueError, match="autoscale=True is invalid: pass the path of a step-cost profile"):
        LLM("unused", attention_ranks=1, expert_ranks=1, autoscale=True)
    with pytest.raises(ValueError, match="step-cost profile .*missing.json"):
        LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1, autoscale=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="autoscale_margin=1.5"):
        LLM("unused", attention_ranks=1, expert_ranks=1, autoscale="p.json", autoscale_margin=1.5)
    with pytest.raises(ValueError, match="autoscale with prefill_ranks=1"):
        LLM("unused", attention_ranks=2, expert_ranks=1, autoscale="p.json", prefill_ranks=1)


def test_the_engine_moves_a_rank_to_the_attention_pool_and_every_output_is_transformers(tiny_checkpoint, tmp_path):
    """A profile where attention work dominates: the 1+2 job moves to 2+1 by itself (the joiner spawned, an
    expert rank retired), and outputs before and after the move are transformers' greedy tokens."""
    path = tiny_checkpoint("qwen3_moe")
    profile = str(tmp_path / "profile.json")
    _costs(a_tok=1e-3, a_ctx=1e-5, moe_layers=2, top_k=2, source="test: attention-bound").save(profile)
    prompts = make_prompts(12, 256, 4, 30, seed=5)
    expected = hf_greedy(path, prompts, 40)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(path, attention_ranks=1, expert_ranks=2, autoscale=profile, autoscale_window=4,
             autoscale_margin=0.05) as llm:
        first = llm.generate(prompts, params)
        deadline = time.monotonic() + 120
        while llm.stats()["pool_ranks"] != {"attention": 2, "expert": 1} and time.monotonic() < deadline:
            llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))   # lets the front spawn
            time.sleep(0.5)
        stats = llm.stats()
        second = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == expected and [o.token_ids for o in second] == expected
    assert stats["pool_ranks"] == {"attention": 2, "expert": 1}
    moves = [c for c in stats["membership_changes"] if c["cause"] == "autoscale"]
    assert len(moves) == 1, stats["membership_changes"]
    assert [d["best"] for d in stats["autoscale"]["decisions"] if d.get("moved")] == [[2, 1]]
