"""bench/deepspeed_moe.py: DeepSpeed-MoE expert parallelism (deepspeed.moe.layer.MoE, ep_size = ranks, gloo on
CPU, launched with torchrun) holding a tiny checkpoint's router and experts gives transformers' own greedy tokens;
and its rank-count choice follows DeepSpeed's num_experts % ep_size == 0."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "bench", "deepspeed_moe.py")
sys.path.insert(0, ROOT)

from bench.deepspeed_moe import ours_splits, parse_ranks  # noqa: E402

TINY = dict(hidden_size=128, num_hidden_layers=4, moe_intermediate_size=64, max_position_embeddings=1024)


def _check(path: str, ranks: str, prompts_per_rank: int = 2, tokens: int = 16) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, SCRIPT, "--model", path, "--check-only", "--ranks", ranks,
                        "--check-tokens", str(tokens), "--check-prompts", str(prompts_per_rank)],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4)], ids=["8x_top2", "16x_top4"])
def test_deepspeed_greedy_tokens_equal_transformers(tiny_checkpoint, experts, top_k):
    # top-2 goes through DeepSpeed's top2gating (2nd-expert sampling off), top-4 through its topkgating.
    path = tiny_checkpoint("qwen3_moe", num_experts=experts, num_experts_per_tok=top_k, **TINY)
    out = _check(path, "2")
    line = next(x for x in out.splitlines() if x.startswith("check DeepSpeed"))
    assert "2 ranks (ep_size 2)" in line and "of 4 prompts" in line, line
    m = re.search(r"PASS \((\d+) tokens equal; max \|logit diff\| ([0-9.e+-]+)\)", line)
    assert m, line
    assert int(m.group(1)) == 2 * 2 * 16          # every token of every prompt on both ranks compared
    assert float(m.group(2)) < 1e-3                # fp32 on both sides: only summation-order rounding


def test_rank_counts_follow_deepspeeds_divisibility():
    assert parse_ranks("auto", 8) == [(2, 2), (4, 4)]     # 3 ranks cannot hold 8 experts evenly
    assert parse_ranks("auto", 16) == [(2, 2), (4, 4)]
    assert parse_ranks("auto", 12) == [(3, 3)]
    assert parse_ranks("auto", 60) == [(3, 3)]
    assert parse_ranks("2,3:1", 8) == [(2, 2), (3, 1)]
    with pytest.raises(SystemExit, match="% ep_size"):
        parse_ranks("3", 8)
    with pytest.raises(SystemExit, match="% ep_size"):
        parse_ranks("3:2", 8)                             # ep_size must divide the world as well
    assert ours_splits(3, None) == [(1, 2)]
    assert ours_splits(2, None) == [(1, 1)]
    assert ours_splits(4, None) == [(1, 3), (2, 2), (3, 1)]
