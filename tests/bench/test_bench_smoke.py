"""The benches `make bench` runs, small (`--smoke`, issue 33): each runs to its end on the shipped model and prints
its result lines. throughput and step_breakdown spawn 1 + 2 ranks; balancer and sync_audit's one cell are
quick. The sync audit's cell must also meet the lean step's bound (one host read per decode step on an attention
rank, none on an expert rank). The full runs stay in `make bench`."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import FULL

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _smoke(script: str) -> str:
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"bench/{script} --smoke failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_throughput_smoke():
    out = _smoke("throughput.py")
    assert "workload: 16 requests" in out
    ours = float(re.search(r"afserve 1\+2 ranks\s*:\s*([\d.]+) output tok/s", out).group(1))
    hf = float(re.search(r"HF generate, batch 64\s*:\s*([\d.]+) output tok/s", out).group(1))
    ratio = float(re.search(r"ratio\s*:\s*([\d.]+)x", out).group(1))
    assert ours > 0 and hf > 0 and abs(ratio - ours / hf) < 0.01, out


@FULL   # ~30 s: make test-full (make test keeps the throughput and sync-audit smokes)
def test_step_breakdown_smoke():
    out = _smoke("step_breakdown.py")
    assert re.search(r"\d+ output tokens in [\d.]+ s .* \d+ steps", out), out
    assert re.search(r"host work per step: [\d.]+ ms of a [\d.]+ ms step", out), out
    assert len(re.findall(r"expert rank \d: grouped FFN", out)) == 2, out


def test_balancer_smoke():
    out = _smoke("balancer.py")
    rows = [line for line in out.splitlines() if line.startswith(("| zipf", "| drift"))]
    # three routings x one rank count x three redundancies, then two routings x four re-placement schemes
    assert len(rows) == 9 + 8, out
    assert sum("| incremental, <= 8 slots a step" in line for line in rows) == 2, out
    assert "target: least_loaded max/mean at 25% redundancy, Zipf 1.0, 16 ranks" in out


def test_balancer_engine_smoke():
    """static and least_loaded, each on an engine of its own, in two rounds (the second in reverse order): both
    rates and their ratio as printed, per round."""
    out = _smoke("balancer_engine.py")
    for r in (1, 2):
        static = float(re.search(rf"round {r}: +static: ([\d.]+) tok/s", out).group(1))
        ll, ratio = re.search(rf"round {r}: least_loaded: ([\d.]+) tok/s, ([\d.]+)x static", out).groups()
        assert static > 0 and abs(float(ratio) - float(ll) / static) < 0.02, out   # rates printed to whole tok/s
    assert re.search(r"least_loaded against static: [\d.]+x \(median over 2 rounds", out), out


@pytest.mark.timeout(600)
def test_sync_audit_smoke():
    out = _smoke("sync_audit.py")
    assert "worst max/decode step: attention 1 (target 1), expert 0 (target 0)" in out, out


@FULL   # ~36 s: make test-full (the server's own tests run in make test)
def test_serve_load_smoke():
    """The server on 1 + 2 ranks at concurrency 2 against HF generate: one table row with its figures."""
    out = _smoke("serve_load.py")
    assert re.search(r"HF generate \(batches of 64\) on the c=2 requests: \d+ tok/s", out), out
    row = re.search(r"^\| 2 \| 16 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) .*\| ([\d.]+)x \|$", out,
                    flags=re.M)
    assert row, out
    ttft50, ttft99, tpot50, tpot99 = (float(row.group(i)) for i in range(1, 5))
    assert 0 < ttft50 <= ttft99 and 0 < tpot50 <= tpot99 and float(row.group(6)) > 0, out


@FULL        # 40 s: make test stays under its 30 minutes
def test_spec_decode_smoke():
    """Off, n-gram drafts and the shipped draft model at concurrency 2: a row each with its TPOT and throughput,
    ratios that are theirs against off, and for the two speculative ones an acceptance rate per draft position."""
    out = _smoke("spec_decode.py")
    rows = {m.group(1): m for m in re.finditer(
        r"^\| 2 \| 8 \| (\w+) \| ([\d.]+) \| ([\d.]+)x \| (\d+) \| ([\d.]+)x \| ([\d.]+) \| ([\d., -]+) \|$", out,
        flags=re.M)}
    assert set(rows) == {"off", "ngram", "draft"}, out
    off_tpot, off_tok_s = float(rows["off"].group(2)), float(rows["off"].group(4))
    for name, row in rows.items():
        tpot, tok_s = float(row.group(2)), float(row.group(4))
        assert tpot > 0 and abs(float(row.group(3)) - off_tpot / tpot) < 0.02, out
        assert tok_s > 0 and abs(float(row.group(5)) - tok_s / off_tok_s) < 0.02, out
    for name in ("ngram", "draft"):
        per_pos = [float(x) for x in rows[name].group(7).split(",")]
        assert len(per_pos) == 3 and 0 < float(rows[name].group(6)) <= 1 and per_pos[0] > 0, out


@FULL
def test_pd_smoke():
    """Colocated and PD (1 prefill + 1 decode + 1 expert rank; its KV streamed, and copied at the move: pd_copy),
    mixed and short workloads: a row each with its latencies and throughput, the PD rows' ratios theirs against
    colocated, and a KV transfer time per move."""
    out = _smoke("pd.py")
    rows = {(m.group(1), m.group(2)): [float(x) for x in m.groups()[2:7]] + [m.group(8)] for m in re.finditer(
        r"^\| (\w+) \| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| (.*) \|$", out,
        flags=re.M)}
    assert set(rows) == {(w, c) for w in ("mixed", "short") for c in ("colocated", "pd", "pd_copy")}, out
    for w, config in ((w, c) for w in ("mixed", "short") for c in ("pd", "pd_copy")):
        coloc, pd = rows[(w, "colocated")], rows[(w, config)]
        assert all(v > 0 for v in coloc[:5] + pd[:5]) and pd[0] <= pd[1] and pd[2] <= pd[3], out
        # the ratios, the KV transfer per move, its share of TTFT p50, the blocks a move carries
        tpot_ratio, tok_ratio, per_move = [x.strip() for x in pd[5].split("|")][:3]
        assert abs(float(tpot_ratio.rstrip("x")) - coloc[3] / pd[3]) < 0.02, out
        assert abs(float(tok_ratio.rstrip("x")) - pd[4] / coloc[4]) < 0.02 and float(per_move) > 0, out


@FULL
def test_elastic_smoke():
    """2 + 3 with an expert rank killed, then 1 + 2 -> 2 + 4 -> 1 + 2, four short requests: every run's outputs
    identical to the run without a failure (the bench checks them against its reference), nothing written."""
    out = _smoke("elastic.py")
    assert re.search(r"median of 1: outage \d+ ms vs restart \d+ ms .*every run identical: True", out), out
    assert re.search(r"median of 1: scale-out \d+ ms .*every run identical: True", out), out


@FULL   # ~45 s (a small calibration and three engines): make test-full; the autoscaler's own tests run in make test
def test_autoscale_smoke():
    """Three runs (static 1+2, static 2+1, the autoscaler from 1+2), one round of each phase: a table row per
    round with its pools, and the phase table with the autoscaler's ratios to both static splits."""
    out = _smoke("autoscale.py")
    rows = [line for line in out.splitlines() if re.match(r"\| (static|autoscale) .* \| \d+ \| (short|long) \|", line)]
    assert len(rows) == 6, out
    assert sum("| static 2+1 |" in r and "| 2+1 |" in r for r in rows) == 2, out
    phase = [line for line in out.splitlines() if line.startswith(("| short |", "| long |"))]
    assert len(phase) == 2 and all(line.count("x |") == 2 for line in phase), out
    assert "autoscaler moves:" in out, out


@FULL   # ~25 s (two of its four engines start the slow way on purpose): make test-full
def test_startup_smoke():
    """Both start methods measured in processes of their own: a row with the first and a later start of each
    and the ratio between the later ones."""
    out = _smoke("startup.py")
    row = re.search(r"^\| 1\+1 \| ([\d.]+) s \| ([\d.]+) s \| ([\d.]+) s \| ([\d.]+) s \| ([\d.]+)x \|$", out, re.M)
    assert row, out
    first_fs, later_fs, first_sp, later_sp, ratio = map(float, row.groups())
    assert min(first_fs, later_fs, first_sp, later_sp) > 0 and abs(ratio - later_sp / later_fs) < 0.1 * ratio, out
