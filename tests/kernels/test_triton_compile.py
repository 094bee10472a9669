"""Every Triton kernel, launched as its wrapper launches it, compiles for the H100/H200 (sm_90) with Triton's own
compiler and ptxas, on this CPU machine: no launch spills registers, every one fits Hopper's shared memory, and
the bf16 prefill and the fused MoE's GEMMs at tile heights 64 and 128 run on Hopper's wgmma tensor-core
instructions (`python -m kernels.aot`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
HOPPER_SHARED_BYTES = 227 * 1024   # the most dynamic shared memory one block may take on sm_90


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                                    "cuobjdump")), reason="this Triton build ships no NVIDIA tools")
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "aot.json"
    r = subprocess.run([sys.executable, "-m", "kernels.aot", "--arch", "90", "--json", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    kernels = {row["name"] for row in rows}
    assert kernels == {"_write_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel",
                       "_gemm1_swiglu_kernel", "_gemm2_weighted_kernel", "_sum_choices_kernel"}
    for row in rows:
        assert row["stack_bytes"] == 0, row           # spilled registers
        assert row["shared_bytes"] <= HOPPER_SHARED_BYTES, row
        assert 0 < row["registers"] <= 255, row
    wgmma = {(row["case"], row["name"]) for row in rows if row["wgmma"] > 0}
    assert ("bf16 prefill", "_prefill_kernel") in wgmma
    for pairs in ("128x8", "1024x8"):
        for name in ("_gemm1_swiglu_kernel", "_gemm2_weighted_kernel"):
            assert (f"bf16 fused_moe {pairs} pairs on 8 slots", name) in wgmma
