"""Projections fused at load time (q/k/v, gate/up): one GEMM gives the separate projections' outputs, and the
parts leave the weight dict."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attention_nodes.model import _fuse_projections


def test_fused_projections_equal_the_separate_ones():
    g = torch.Generator().manual_seed(0)
    H = 32
    a, m = "model.layers.0.self_attn", "model.layers.0.mlp"
    parts = {f"{a}.q_proj": 64, f"{a}.k_proj": 16, f"{a}.v_proj": 16, f"{m}.gate_proj": 48, f"{m}.up_proj": 48}
    w = {f"{n}.weight": torch.randn(o, H, generator=g) for n, o in parts.items()}
    w[f"{a}.k_proj.bias"] = torch.randn(16, generator=g)     # a bias on one part only: the others get zeros
    w[f"{m}.down_proj.weight"] = torch.randn(H, 48, generator=g)
    separate = dict(w)
    fused = _fuse_projections(w)
    assert set(fused) == {f"{a}.qkv_proj", f"{m}.gate_up_proj"}
    assert set(w) == {f"{m}.down_proj.weight"}
    x = torch.randn(5, H, generator=g)
    groups = {f"{a}.qkv_proj": ["q_proj", "k_proj", "v_proj"], f"{m}.gate_up_proj": ["gate_proj", "up_proj"]}
    for name, names in groups.items():
        weight, bias, sizes = fused[name]
        outs = F.linear(x, weight, bias).split(sizes, dim=-1)
        prefix = name.rsplit(".", 1)[0]
        for out, n in zip(outs, names):
            want = F.linear(x, separate[f"{prefix}.{n}.weight"], separate.get(f"{prefix}.{n}.bias"))
            torch.testing.assert_close(out, want)


def test_incomplete_groups_stay_unfused():
    """MLA's q_proj has no k_proj/v_proj beside it: nothing is fused or removed."""
    w = {"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4)}
    assert _fuse_projections(w) == {}
    assert list(w) == ["model.layers.0.self_attn.q_proj.weight"]
