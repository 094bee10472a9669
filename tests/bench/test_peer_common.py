"""bench/peer_common.py (core utilisation from /proc, greedy-token comparison) and the argument and environment
helpers of bench/peers.py and bench/vllm_peer.py. None of this needs vLLM."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from bench.peer_common import (  # noqa: E402
    CpuSample,
    describe_difference,
    first_difference,
    parse_pid_stat,
    tree_ticks,
)
from bench.peers import parse_splits, timed_workloads  # noqa: E402
from bench.throughput import workload  # noqa: E402
from bench.vllm_peer import PEER_ENV, peer_env, peer_python  # noqa: E402
from models import SHIPPED_MODEL  # noqa: E402


def write_proc(root, cpu_line: str, procs: dict[int, tuple[str, int, int, int]]) -> str:
    """A fake /proc: the stat file, and per pid (comm, ppid, utime, stime) a <pid>/stat in the kernel's layout."""
    (root / "stat").write_text(cpu_line + "\ncpu0 1 2 3 4\n")
    for pid, (comm, ppid, utime, stime) in procs.items():
        (root / str(pid)).mkdir()
        fields = ["S", ppid, pid, pid, 0, -1, 4194560, 10, 0, 0, 0, utime, stime, 0, 0, 20, 0, 1]
        (root / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(map(str, fields)))
    (root / "self").mkdir()   # not a pid: skipped
    return str(root)


def test_stat_line_busy_and_total():
    # user nice system idle iowait irq softirq steal guest guest_nice
    s = CpuSample.from_stat_line("cpu  100 10 50 800 40 5 3 2 7 1")
    assert s.total == 100 + 10 + 50 + 800 + 40 + 5 + 3 + 2   # guest time is already in user and nice
    assert s.busy == 100 + 10 + 50 + 5 + 3 + 2
    with pytest.raises(ValueError, match="aggregate cpu line"):
        CpuSample.from_stat_line("cpu0 1 2 3 4")


def test_since_gives_busy_and_own_shares():
    before = CpuSample(busy=1000, total=4000, own=100)
    after = CpuSample(busy=1150, total=4200, own=180)
    u = after.since(before)
    assert u.busy == pytest.approx(150 / 200)
    assert u.own == pytest.approx(80 / 200)
    assert math.isnan(CpuSample(1150, 4200).since(CpuSample(1000, 4000)).own)   # no tree was read
    assert math.isnan(before.since(before).busy)                                # no tick passed


def test_pid_stat_with_spaces_and_parentheses_in_the_name():
    text = "4242 (vllm (engine) core) R 17 4242 4242 0 -1 4194560 10 0 0 0 321 45 0 0 20 0 3"
    assert parse_pid_stat(text) == (17, 321 + 45)


def test_tree_ticks_sums_the_descendants_only(tmp_path):
    proc = write_proc(tmp_path, "cpu  1 0 1 10 0 0 0 0 0 0", {
        10: ("python", 1, 5, 1),        # the root
        11: ("rank 0", 10, 100, 20),    # its child
        12: ("w (x)", 11, 30, 3),       # a grandchild
        20: ("other", 1, 999, 999),     # not in the tree
    })
    assert tree_ticks(10, proc) == 6 + 120 + 33
    assert tree_ticks(11, proc) == 120 + 33
    assert CpuSample.read(10, proc) == CpuSample(busy=2, total=12, own=159)


def test_tree_ticks_counts_a_busy_child_on_the_real_proc():
    """Against an independent statement: the grandchild's own os.times() of the CPU it burnt. The tree is rooted
    at a parent process of the test's own (pytest's tree holds whatever earlier tests left running; one of them
    exiting between two readings took its ticks out of the difference, failing a CI run)."""
    code = ("import os, sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
            "c = os.times()\nprint(c.user + c.system, flush=True)\nsys.stdin.readline()\n")
    parent_code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {code!r}])\n"
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        burnt_s = float(parent.stdout.readline())   # the grandchild is still alive, waiting on stdin
        grown = tree_ticks(parent.pid)
    finally:
        parent.communicate("\n", timeout=30)
    hz = os.sysconf("SC_CLK_TCK")
    assert round(burnt_s * hz) >= 0.4 * hz - 1      # in whole ticks, which os.times() counts (a float sum)
    assert grown >= 0.9 * burnt_s * hz - 2, (grown, burnt_s * hz)


def test_first_difference():
    a = [[1, 2, 3], [4, 5, 6]]
    assert first_difference(a, [[1, 2, 3], [4, 5, 6]]) is None
    assert first_difference(a, [[1, 2, 3], [4, 9, 6]]) == (1, 1)
    assert first_difference(a, [[1, 2], [4, 5, 6]]) == (0, 2)        # a shorter output
    assert first_difference(a, [[1, 2, 3]]) == (1, 0)                # a missing request
    assert first_difference([[7]], [[8]]) == (0, 0)


def test_describe_difference_names_both_engines():
    ours = [[1, 2, 3, 4, 5, 6, 7]]
    msg = describe_difference(ours, [[1, 2, 3, 4, 9, 6, 7]], ("afserve 1+1", "vLLM"))
    assert msg == "request 0, position 4: afserve 1+1 gave [3, 4, 5, 6, 7], vLLM [3, 4, 9, 6, 7] (from position 2)"
    assert describe_difference(ours, ours, ("a", "b")) is None


def test_parse_splits():
    assert parse_splits("1+1,1+2") == [(1, 1), (1, 2)]
    assert parse_splits(" 2+1 ") == [(2, 1)]
    for bad in ("1+0", "3+1", "12", "a+b"):
        with pytest.raises(ValueError, match="--splits"):
            parse_splits(bad)


def test_fresh_timed_workloads_share_no_prompt_start_with_each_other_or_the_check():
    """--prompts fresh exists to take the cross-run prefix-cache hits away: a timed run begins hardly any prompt
    with the first block (16 tokens) of a prompt that the check, the warm-up or another run sent (random passages
    of the play coincide now and then: at most 1 in 64 here)."""
    prompts, olens = workload(64)
    assert timed_workloads("repeat", 64, 3, SHIPPED_MODEL, prompts, olens) == [(prompts, olens)] * 3
    runs = timed_workloads("fresh", 64, 3, SHIPPED_MODEL, prompts, olens)
    assert len(runs) == 3 and all(len(p) == len(o) == 64 for p, o in runs)
    firsts = [{tuple(p[:16]) for p in ps} for ps, _ in [(prompts, olens), *runs]]
    for i in range(len(firsts)):
        for j in range(i):
            assert len(firsts[i] & firsts[j]) <= 1, (i, j)


def test_peer_venv_missing_says_how_to_build_it(tmp_path):
    with pytest.raises(RuntimeError, match="make peers"):
        peer_python(str(tmp_path / "no-venv"))


def test_peer_env_drops_pythonpath_and_keeps_the_callers_values(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/afserve")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    env = peer_env()
    assert "PYTHONPATH" not in env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert all(k in env for k in PEER_ENV)
