"""`attention_nodes.routing.route` chooses the same experts with the same weights as transformers' own router
modules: DeepSeek-V2 (softmax, greedy and group-limited), DeepSeek-V3 and GLM-4.5 (sigmoid scores, the
score-correction bias for selection only, group-limited), on configs made by `models.tiny.tiny_config` and
specs read by `models.spec.spec_from_hf_config`.

transformers picks with sorted=False, so ids are compared per token as sets (sorted), and each weight is
compared on the expert it belongs to.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from attention_nodes.routing import route
from models.spec import spec_from_hf_config
from models.tiny import tiny_config

T = 64
ROUTERS = {"deepseek_v2": "DeepseekV2TopkRouter", "deepseek_v3": "DeepseekV3TopkRouter",
           "glm4_moe": "Glm4MoeTopkRouter"}
V2_GROUPED = dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)
# (arch, config overrides): each router kind, plus the knobs that change its arithmetic
CASES = [
    ("deepseek_v2", {}),
    ("deepseek_v2", dict(routed_scaling_factor=16.0)),
    ("deepseek_v2", V2_GROUPED),
    ("deepseek_v2", dict(V2_GROUPED, n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.0)),
    ("deepseek_v3", {}),
    ("deepseek_v3", dict(norm_topk_prob=False)),
    ("deepseek_v3", dict(n_group=1, topk_group=1)),
    ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=3)),
    ("glm4_moe", {}),
    ("glm4_moe", dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2)),
]
IDS = [f"{arch}-{'-'.join(f'{k}={v}' for k, v in ov.items()) or 'default'}" for arch, ov in CASES]


def hf_router(arch: str, cfg, seed: int):
    """transformers' router module of arch with a random weight (and, where it has one, a random correction
    bias at DeepSeek's scale, large enough to change choices)."""
    cls = getattr(importlib.import_module(f"transformers.models.{arch}.modeling_{arch}"), ROUTERS[arch])
    router = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.1)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(router.e_score_correction_bias.shape, generator=g) * 0.2)
    return router


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ids in ascending order, with their weights alongside."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


def run_hf(router, x: torch.Tensor):
    with torch.no_grad():
        logits, weights, ids = router(x)
    return logits, *by_expert(weights, ids)


def run_ours(spec, router, x: torch.Tensor):
    bias = getattr(router, "e_score_correction_bias", None)
    weights, ids = route(spec, x, router.weight.detach(), None if bias is None else bias.detach())
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (x.shape[0], spec.top_k)
    return by_expert(weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,overrides", CASES, ids=IDS)
def test_route_equals_transformers_router(arch, overrides, dtype):
    cfg = tiny_config(arch, **overrides)
    spec = spec_from_hf_config(cfg)
    router = hf_router(arch, cfg, seed=CASES.index((arch, overrides))).to(dtype)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    _, hf_weights, hf_ids = run_hf(router, x)
    weights, ids = run_ours(spec, router, x)
    assert torch.equal(ids, hf_ids), f"tokens choosing differently: {(ids != hf_ids).any(-1).nonzero().view(-1)}"
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)
    assert len({tuple(r) for r in ids.tolist()}) > 1   # not a degenerate router: tokens choose differently


@pytest.mark.parametrize("arch,overrides", [c for c in CASES if c[0] != "deepseek_v2"],
                         ids=[i for c, i in zip(CASES, IDS) if c[0] != "deepseek_v2"])
def test_correction_bias_selects_but_does_not_weigh(arch, overrides):
    """V3 / GLM: the bias changes which experts some tokens get (transformers with a zeroed bias picks
    otherwise, and route without a bias agrees with that), while the weights stay the unbiased sigmoid scores
    of the chosen experts, renormalised when norm_topk_prob, times routed_scaling_factor."""
    cfg = tiny_config(arch, **overrides)
    spec = spec_from_hf_config(cfg)
    router = hf_router(arch, cfg, seed=3)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    logits, _, hf_ids = run_hf(router, x)
    weights, ids = run_ours(spec, router, x)
    assert torch.equal(ids, hf_ids)

    unbiased = hf_router(arch, cfg, seed=3)
    with torch.no_grad():
        unbiased.e_score_correction_bias.zero_()
    _, plain_weights, plain_ids = run_hf(unbiased, x)
    changed = (plain_ids != hf_ids).any(dim=-1)
    assert changed.any(), "the correction bias changed no token's experts: the test shows nothing"
    no_bias = by_expert(*route(spec, x, router.weight.detach(), None))
    assert torch.equal(no_bias[1], plain_ids)
    torch.testing.assert_close(no_bias[0], plain_weights, atol=1e-6, rtol=1e-6)

    expected = logits.sigmoid().gather(1, hf_ids)   # unbiased scores from transformers' own logits
    if cfg.norm_topk_prob:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    expected = expected * cfg.routed_scaling_factor
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-6)
    biased = (logits.sigmoid() + router.e_score_correction_bias).gather(1, hf_ids)
    biased = biased / biased.sum(dim=-1, keepdim=True) if cfg.norm_topk_prob else biased
    assert not torch.allclose(weights, biased * cfg.routed_scaling_factor, atol=1e-3)


def test_group_limit_changes_choices():
    """DeepSeek-V2 group_limited_greedy: some tokens' experts differ from the plain greedy top-k, all chosen
    experts lie in at most topk_group groups, and the weights are the chosen softmax probabilities, unnormalised,
    times routed_scaling_factor. With top_k <= topk_group (the tiny default) the limit can never bind, since
    V2 ranks a group by its best expert; picking 4 of 16 experts from 2 of 4 groups it does."""
    cfg = tiny_config("deepseek_v2", **V2_GROUPED, n_routed_experts=16, num_experts_per_tok=4,
                      routed_scaling_factor=3.0)
    spec = spec_from_hf_config(cfg)
    router = hf_router("deepseek_v2", cfg, seed=5)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    logits, _, hf_ids = run_hf(router, x)
    weights, ids = run_ours(spec, router, x)
    assert torch.equal(ids, hf_ids)
    probs = logits.softmax(dim=-1)
    greedy = probs.topk(cfg.num_experts_per_tok, dim=-1)[1].sort(dim=-1)[0]
    assert (greedy != ids).any(dim=-1).any(), "the group limit changed no token's experts: the test shows nothing"
    group_size = cfg.n_routed_experts // cfg.n_group
    assert max(len(set((ids // group_size)[t].tolist())) for t in range(T)) <= cfg.topk_group
    torch.testing.assert_close(weights, probs.gather(1, ids) * cfg.routed_scaling_factor, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch,overrides", [
    ("deepseek_v3", dict(n_group=3)),
    ("glm4_moe", dict(n_group=3)),
    ("deepseek_v2", dict(V2_GROUPED, n_group=3)),
    ("deepseek_v3", dict(n_routed_experts=12, n_group=8)),
])
def test_n_group_must_divide_the_experts(arch, overrides):
    cfg = tiny_config(arch, **overrides)
    with pytest.raises(ValueError, match=rf"n_group={overrides['n_group']}\b"):
        spec_from_hf_config(cfg)


@pytest.mark.parametrize("arch,overrides", [
    ("deepseek_v3", dict(n_group=4, topk_group=5)),
    ("glm4_moe", dict(n_group=2, topk_group=3)),
    ("deepseek_v2", dict(V2_GROUPED, topk_group=0)),
])
def test_topk_group_must_be_within_n_group(arch, overrides):
    with pytest.raises(ValueError, match=rf"topk_group={overrides['topk_group']}\b"):
        spec_from_hf_config(tiny_config(arch, **overrides))


def test_v2_greedy_ignores_group_settings():
    """Plain greedy V2 never reads n_group, so a non-dividing one is no error and routing is unchanged."""
    cfg = tiny_config("deepseek_v2", n_group=3, topk_group=2)
    spec = spec_from_hf_config(cfg)
    assert spec.router == "softmax"
    router = hf_router("deepseek_v2", cfg, seed=7)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    _, hf_weights, hf_ids = run_hf(router, x)
    weights, ids = run_ours(spec, router, x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)
