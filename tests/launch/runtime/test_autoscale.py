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


def test_the_leader_hands_a_refused_move_back_to_the_autoscaler():
    """Membership.between_steps: the autoscaler's request that the leader refuses is answered ("autoscaled",
    record) and reaches the autoscaler as a refusal (its back-off starts); a user's refused scale after it is
    answered as ("scale", record) and is no refusal of the autoscaler's."""
    from launch.runtime.membership import Membership
    scaler = _scaler(_costs(a_tok=1e-3))
    request = _feed(scaler, (1, 2), [64, 64, 64, 64], 4)[0]
    member = Membership.__new__(Membership)
    member._rt = SimpleNamespace(generation=0, leader=SimpleNamespace(autoscaler=scaler))
    member._last_poll = time.monotonic() + 3600     # no look for joiners in this test
    member.scale_as_leader = lambda req, outbox: {"error": f"refused {req.get('cause', 'user')}"}
    outbox = queue.Queue()
    scales = [dict(request, spawn=True, reply="autoscaled"), {"attention_ranks": 3, "retire": []}]
    assert member.between_steps(scales, outbox, lambda action: action()) is False
    assert scales == [] and [outbox.get_nowait(), outbox.get_nowait()] == [
        ("autoscaled", {"error": "refused autoscale"}), ("scale", {"error": "refused user"})]
    assert [d for d in scaler.decisions if "refused" in d] == [
        {"refused": [2, 1], "why": "refused autoscale", "back_off_steps": 2}]


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
    llm._outbox, llm.check_alive = outbox, lambda what: None
    llm._spawn_joiner = lambda role, member: started.append((role, member))
    llm.config = SimpleNamespace(startup_timeout_s=60.0)
    outbox.put(("spawn", ["expert"], time.monotonic() + 10, [3]))
    outbox.put(("spawn", ["attention", "expert"], time.monotonic() + 50, [4, 5]))
    outbox.put(("out", []))
    assert llm._poll(outbox, None, "test") == ("out", []) and started == [("attention", 4), ("expert", 5)]


def test_the_leader_draws_the_member_ids_of_the_ranks_it_asks_for_from_the_joiners_counter():
    """A --pool-addr joiner draws its member id from the job's store counter; the ranks the front starts for a
    scale request take ids the leader draws from the same counter (they took their index among the front's
    processes before, and the first of them collided with such a joiner's)."""
    import torch.distributed as dist

    from launch.runtime.liveness import MEMBER_IDS
    from launch.runtime.runtime import Runtime
    rt = Runtime.__new__(Runtime)
    rt.store = dist.HashStore()
    rt.store.add(MEMBER_IDS, 3 - 1)             # the leader of a 3-rank launch reserves ids 1 and 2
    outside = int(rt.store.add(MEMBER_IDS, 1))  # a --pool-addr joiner (runtime.py, no AFSERVE_MEMBER)
    assert outside == 3 and rt.new_member_ids(2) == [4, 5]


def test_bad_settings_are_refused_by_name(tmp_path, monkeypatch):
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
    profile = str(tmp_path / "p.json")
    _costs().save(profile)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")      # under torchrun, ranks that call generate() together
    with pytest.raises(ValueError, match="autoscale needs ranks that follow the leader until shutdown: under "
                                         "torchrun serve with launch/serve.py --autoscale"):
        LLM(SHIPPED_MODEL, attention_ranks=1, expert_ranks=1, autoscale=profile)


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
        retired = list(llm.retired_ranks)
    assert [o.token_ids for o in first] == expected and [o.token_ids for o in second] == expected
    assert stats["pool_ranks"] == {"attention": 2, "expert": 1}
    moves = [c for c in stats["membership_changes"] if c["cause"] == "autoscale"]
    assert len(moves) == 1, stats["membership_changes"]
    assert retired == moves[0]["lost_members"] and len(retired) == 1     # the expert rank the move retired
    assert [d["best"] for d in stats["autoscale"]["decisions"] if d.get("moved")] == [[2, 1]]


def test_serve_under_torchrun_moves_a_rank_and_every_completion_is_transformers(tiny_checkpoint, tmp_path):
    """serve.py --autoscale under torchrun: no front spawned the job, so the leader starts the joining attention
    rank beside itself (launch/joiners.py) with a member id past the launch's three, retires the last
    expert rank (a torchrun worker, which exits 0 while the launch goes on), and every completion before, during
    and after the move is transformers' greedy text."""
    import concurrent.futures

    import openai
    from transformers import AutoTokenizer

    from launch.local_server import LocalServer
    from tests.launch.runtime.test_pools import gauge, wait_for_pools

    path = tiny_checkpoint("qwen3_moe")
    profile = str(tmp_path / "profile.json")
    _costs(a_tok=1e-3, a_ctx=1e-5, moe_layers=2, top_k=2, source="test: attention-bound").save(profile)
    prompts = make_prompts(6, 256, 4, 20, seed=7)
    tok = AutoTokenizer.from_pretrained(path)
    expected = [tok.decode(t, skip_special_tokens=True) for t in hf_greedy(path, prompts, 24)]
    args = ["--attention-ranks", "1", "--autoscale", profile, "--autoscale-window", "4", "--autoscale-margin",
            "0.05", "--max-model-len", "128", "--heartbeat-s", "0.5", "--served-model-name", "tiny"]
    with LocalServer(path, nproc=3, args=args) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=240)

        def complete(p):
            got = client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
            return got.choices[0].text
        texts, deadline = [], time.monotonic() + 120
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            while gauge(srv, "afserve_pool_ranks", '{pool="attention"}') != 2 and time.monotonic() < deadline:
                texts.append(list(pool.map(complete, prompts)))
            wait_for_pools(srv, 2, 1)
            texts.append(list(pool.map(complete, prompts)))     # on the re-formed 2 + 1
        assert gauge(srv, "afserve_membership_changes_total") == 1
        assert srv.health() == 200
        log = srv.log()
    assert all(t == expected for t in texts), (texts, expected)
    assert "the engine failed" not in log and "cannot join" not in log, log[-3000:]


def test_a_joiner_start_that_fails_midway_leaves_none_of_its_request_running(monkeypatch):
    """JoinerStarter.start (the leader's own joiners under torchrun) for two roles where the second process
    cannot start: the first is killed again (alone it would join past its refused request) and the error goes
    to the caller (Membership.scale_as_leader refuses the request with it). Member ids come from the store's
    counter."""
    import launch.joiners as joiners

    class Proc:
        made: list = []

        def __init__(self, target, name, daemon, args):
            if len(Proc.made) == 1:
                raise OSError("no more processes")
            self.killed, self.pid = False, 100 + len(Proc.made)
            Proc.made.append(self)

        def start(self):
            pass

        def is_alive(self):
            return not self.killed

        def kill(self):
            self.killed = True

    class Store:
        n = 2

        def add(self, key, by):
            assert key == "afserve/member_ids"
            Store.n += by
            return Store.n

    monkeypatch.setattr(joiners.threading, "Thread", lambda **kw: SimpleNamespace(start=lambda: None))
    monkeypatch.setattr(joiners, "rank_context", lambda: SimpleNamespace(Process=Proc, Queue=queue.Queue))
    from launch.config import EngineConfig
    config = EngineConfig.from_options(SHIPPED_MODEL, 1, 2, device="cpu")
    starter = joiners.JoinerStarter(config, Store(), "127.0.0.1:1234", 3)
    with pytest.raises(OSError, match="no more processes"):
        starter.start(["attention", "expert"], None)
    assert len(Proc.made) == 1 and Proc.made[0].killed and starter.members == [3] and starter.slots == [3]
