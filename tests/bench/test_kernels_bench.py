"""bench/kernels.py: without CUDA it says so and exits 0; its --smoke run (tiny shapes, Triton interpreter on
CPU) goes through every op and shape family and writes rows whose figures hang together."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "kernels.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it measures")
def test_without_cuda_it_says_so_and_exits_0():
    r = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA device" in r.stdout


def test_smoke_run_writes_every_row(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "k.json"
    r = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    ops = [row["op"] for row in data["rows"]]
    assert ops == ["decode"] * 2 + ["prefill"] * 2 + ["fused_moe"] * 4
    assert data["limits"]["copy_GBps"] > 0 and data["limits"]["matmul_TFLOPs"] > 0
    for row in data["rows"]:
        assert row["ms_p20"] <= row["ms"] <= row["ms_p80"] and row["rate"] > 0
        assert math.isclose(row["vs_torch"], row["torch_ms"] / row["ms"], rel_tol=1e-9)
        assert row["max_rel_err"] < 0.03, row      # bf16 against bf16 references: a few bf16 ulps (2^-8)
        assert row["shape"] in r.stdout
