"""launch/comm_profile.py: the simulated profile counts each mode's messages as planned and its trace adds up to the
predicted layer; the measured profile under torchrun reports every MoE layer with two_phase's one inter-node
message per node pair, compute on both roles and a per-rank timeline; comm_stats carries events only when asked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch import LLM, SamplingParams
from launch.comm_profile import main
from launch.procs import free_port
from tests.conftest import wider

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _outputs(out: str) -> tuple[dict, dict]:
    assert os.path.getsize(os.path.join(out, "profile.png")) > 0
    with open(os.path.join(out, "profile.json")) as f, open(os.path.join(out, "trace.json")) as g:
        return json.load(f), json.load(g)


def test_simulated_profile_counts_planned_messages(tmp_path, capsys):
    out = str(tmp_path / "sim")
    assert main(["--simulate", "--attention-ranks", "4", "--expert-ranks", "4", "--ranks-per-node", "2",
                 "--hidden", "256", "--top-k", "4", "--tokens", "8,64", "--out", out]) == 0
    assert "PREDICTED" in capsys.readouterr().out
    profile, trace = _outputs(out)
    assert [e["tokens"] for e in profile["sizes"]] == [8, 64]
    for e in profile["sizes"]:
        for ph in ("dispatch", "combine"):
            # attention on nodes 0-1, experts on nodes 2-3: every (attention, expert) pair crosses nodes
            assert e["direct"][ph]["inter_messages"] == 16 and e["direct"][ph]["intra_messages"] == 0
            assert e["two_phase"][ph]["inter_messages"] == 4                      # nodes_A x nodes_E
            assert e["two_phase"][ph]["intra_messages"] > 0
        assert e["two_phase_over_direct"] == pytest.approx(e["two_phase"]["layer_s"] / e["direct"]["layer_s"])
        assert sum(e["two_phase"]["hops_s"]) == pytest.approx(e["two_phase"]["layer_s"])
    spans = [ev for ev in trace["traceEvents"] if ev["ph"] == "X" and ev["pid"] == 1 and ev["tid"] == 1]
    assert len(spans) == 6                                                       # two_phase: 3 hops each way
    assert sum(ev["dur"] for ev in spans) == pytest.approx(profile["sizes"][1]["two_phase"]["layer_s"] * 1e6)


@pytest.mark.parametrize("argv,message", [
    (["--simulate", "--attention-ranks", "2", "--expert-ranks", "2", "--ranks-per-node", "0"], "--ranks-per-node"),
    (["--simulate", "--attention-ranks", "2", "--expert-ranks", "2", "--ranks-per-node", "2", "--tokens", "8,x"],
     "--tokens"),
    (["--model", "", "--prompts", "4"], "--model")])  # --model defaults to the shipped model
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert message in str(e.value) + capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen3_moe", wider("deepseek_v3")])   # DeepSeek-V3: a dense first layer, MLA
def test_measured_profile_under_torchrun(tiny_checkpoint, tmp_path, arch):
    path = tiny_checkpoint(arch)
    out = str(tmp_path / "measured")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           os.path.join(ROOT, "launch", "comm_profile.py"), "--model", path, "--attention-ranks", "2",
           "--comm", "two_phase", "--ranks-per-node", "2", "--prompts", "4", "--prompt-len", "12",
           "--max-tokens", "3", "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MEASURED" in proc.stdout
    profile, trace = _outputs(out)
    with LLM(path, attention_ranks=1, expert_ranks=1) as llm:
        moe_layers = sum(llm.spec.moe_layers)
    assert [r["layer"] for r in profile["layers"]] == list(range(moe_layers))
    for row in profile["layers"]:
        for ph in ("dispatch", "combine"):
            p = row[ph]
            assert p["calls"] > 0 and p["time_per_call_s"] > 0
            assert p["inter_messages"] == p["calls"]       # one node pair (attention node -> expert node) per call
        assert row["attention_compute_per_call_s"] > 0 and row["expert_compute_per_call_s"] > 0
        assert row["expert_max_mean"] >= 1.0
    spans = [ev for ev in trace["traceEvents"] if ev["ph"] == "X"]
    assert {ev["tid"] for ev in spans} == {0, 1, 2, 3} and all(ev["dur"] >= 0 for ev in spans)
    assert {ev["cat"] for ev in spans} == {"compute", "dispatch", "combine"}


def test_comm_stats_carries_events_only_when_asked(tiny_checkpoint):
    with LLM(tiny_checkpoint("qwen3_moe"), attention_ranks=1, expert_ranks=2) as llm:
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2, ignore_eos=True))
        plain, full = llm.comm_stats(), llm.comm_stats(events=True)
    assert all("events" not in r for r in plain["ranks"].values())
    for r in full["ranks"].values():
        assert r["events"] and all(start <= end for _, _, start, end in r["events"])
        assert r["compute"]                           # both roles time their own compute per layer


def test_attention_ranks_time_their_steps_and_the_forward_within_them(tiny_checkpoint):
    """comm_stats' "steps" on attention ranks: one per step the engine counted (llm.stats()["steps"], the leader's
    own counter), the forward inside each, and at least the forward's timed compute; expert ranks have none."""
    with LLM(tiny_checkpoint("qwen3_moe"), attention_ranks=2, expert_ranks=1) as llm:
        llm.generate([[3, 4, 5], [6, 7, 8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
        stats, steps = llm.comm_stats(), llm.stats()["steps"]
    for r in ("0", "1"):
        s, rank = stats["ranks"][r]["steps"], stats["ranks"][r]
        assert s["calls"] == steps > 0
        compute = sum(c["time_s"] for c in rank["compute"].values())
        assert 0 < compute <= s["forward_s"] < s["time_s"]
    assert "steps" not in stats["ranks"]["2"]
