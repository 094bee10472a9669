"""The A:E autoscaler (launch/runtime/autoscale.py): its decisions from hand-made step costs and reported work,
and, in an engine, a move between the pools with every output still transformers'."""
from __future__ import annotations

import time

import pytest

from launch import LLM, SamplingParams
from launch.plan.model import Plan, StepCosts
from launch.runtime.autoscale import Autoscaler
from tests.conftest import hf_greedy, make_prompts


def _costs(**kw) -> StepCosts:
    base = dict(a0=0.0, a_tok=0.0, a_ctx=0.0, e0=0.0, e_pair=0.0, c0=0.0, c_tok=0.0, l0=0.0, l_row=0.0, h0=0.0,
                h_seq=0.0, moe_layers=1, top_k=1)
    return StepCosts(**{**base, **kw})


def _scaler(costs: StepCosts, budget: int = 3, window: int = 2, margin: float = 0.1, experts: int = 8):
    return Autoscaler(costs, Plan(1, 1, micro_batches=1), budget, experts, window, margin)


def _feed(scaler: Autoscaler, pools: tuple[int, int], work: list[int], steps: int, pending: bool = False):
    """steps identical steps whose summed work is `work`, spread over the attention ranks -> the requests."""
    A = pools[0]
    per = [[-(-x // A) for x in work]] * A
    return [r for _ in range(steps) if (r := scaler.observe(*pools, per, [0.01] * A, [0.02] * A, pending))]


def test_an_attention_bound_window_moves_ranks_to_the_attention_pool():
    """Attention costs 1 ms per token, experts nothing: 64 tokens take 64 ms on one attention rank, 32 on two; so
    from 1+2 the budget of 3 goes to 2+1, asked once, after the dwell (a window) and one measured window."""
    scaler = _scaler(_costs(a_tok=1e-3))
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 3) == []        # 2 steps of dwell, 1 measured
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 1) == [{"attention_ranks": 2, "expert_ranks": 1,
                                                            "cause": "autoscale"}]
    d = scaler.decisions[-1]
    assert d["model_s"] == pytest.approx(0.064) and d["predicted_s"] == pytest.approx(0.032) and d["moved"]
    assert d["attention_util"] == pytest.approx(0.5) and d["step_s"] == pytest.approx(0.02)
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 8, pending=True) == []    # asked: nothing more meanwhile


def test_an_expert_bound_window_moves_ranks_to_the_expert_pool_within_the_experts():
    """Experts cost 1 ms per pair: with top-2 and 64 tokens, 128 ms on one expert rank, 32 on four. From 4+1 (budget
    5) the best split is 1+4; with only 3 experts in the model, an expert pool has at most 3 ranks: 2+3."""
    costs = _costs(e_pair=1e-3, top_k=2)
    assert _feed(_scaler(costs, budget=5), (4, 1), [64, 0, 64, 64], 4)[-1]["expert_ranks"] == 4
    got = _feed(_scaler(costs, budget=5, experts=3), (4, 1), [64, 0, 64, 64], 4)
    assert got == [{"attention_ranks": 2, "expert_ranks": 3, "cause": "autoscale"}]


def test_no_move_below_the_margin_or_on_an_already_best_split():
    """a_tok and e_pair alike: 1+1+... splits differ little. With a fixed cost a0 per layer dominating, moving from
    1+2 to 2+1 gains under 10%: no move (recorded as not moved). From the best split itself: no move either."""
    costs = _costs(a0=1.0, a_tok=1e-3)
    scaler = _scaler(costs, margin=0.1)
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 8) == []
    assert scaler.decisions and not any(d["moved"] for d in scaler.decisions)
    assert scaler.decisions[-1]["best"] == [2, 1]
    best = _scaler(_costs(a_tok=1e-3))
    assert _feed(best, (2, 1), [64, 64, 64, 64], 8) == [] and best.decisions[-1]["best"] == [2, 1]


def test_a_request_given_up_is_asked_again_after_a_dwell_and_empty_steps_are_not_measured():
    """The leader dropped the request (pending False while the pools are unchanged): the autoscaler records it,
    skips a window and asks again. Steps without tokens count for nothing."""
    scaler = _scaler(_costs(a_tok=1e-3))
    assert len(_feed(scaler, (1, 2), [64, 64, 64, 64], 4)) == 1
    assert _feed(scaler, (1, 2), [0, 0, 0, 0], 10) == []            # idle steps: nothing measured or asked
    assert scaler.decisions[-1] == {"gave_up": [2, 1]}
    assert _feed(scaler, (1, 2), [64, 64, 64, 64], 3) == []         # 2 of dwell, then 1 of the window
    assert len(_feed(scaler, (1, 2), [64, 64, 64, 64], 1)) == 1


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="autoscale_window=0"):
        _scaler(_costs(), window=0)
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
             autoscale_margin=0.1) as llm:
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
