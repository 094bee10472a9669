"""Routers: router logits -> each token's top-k experts and their weights, with the exact arithmetic of
transformers' modules (selection, renormalisation and scaling in fp32).

- "softmax" (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2 "greedy"): softmax over experts, top-k.
- "softmax_group" (DeepSeek-V2 "group_limited_greedy"): softmax; keep the topk_group groups with the
  highest single score; top-k among their experts.
- "sigmoid_group" (DeepSeek-V3, GLM-4.5): sigmoid scores; the score-correction bias is added for selection
  only; a group's score is the sum of its two best biased scores; top-k among the best topk_group groups;
  the weights are the unbiased scores of the chosen experts.
- "topk_softmax" (GPT-OSS): biased logits, top-k, softmax over the chosen logits only.
Then optional renormalisation (norm_topk_prob) and routed_scaling_factor.
Names: T tokens, E experts, K top-k, G groups.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.spec import ModelSpec


def route(spec: ModelSpec, x: torch.Tensor, gate: torch.Tensor, correction_bias: torch.Tensor | None = None,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, H]`, gate `[E, H]` (bias `[E]`: GPT-OSS's router bias) -> (weights `[T, K]` fp32, ids `[T, K]`
    int64)."""
    if spec.router == "topk_softmax":
        top, ids = torch.topk(F.linear(x, gate, bias), spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1).float(), ids
    if not spec.router_in_fp32:
        return softmax_topk(F.linear(x, gate), spec.top_k, spec.norm_topk_prob, spec.routed_scaling_factor)
    logits = F.linear(x.float(), gate.float())
    if spec.router == "softmax":
        return softmax_topk(logits, spec.top_k, spec.norm_topk_prob, spec.routed_scaling_factor)
    if spec.router == "softmax_group":
        scores = torch.softmax(logits, dim=-1)
        group_scores = scores.view(-1, spec.n_group, spec.num_experts // spec.n_group).amax(dim=-1)
        weights, ids = torch.topk(_keep_groups(scores, group_scores, spec, 0.0), spec.top_k, dim=-1)
    elif spec.router == "sigmoid_group":
        scores = logits.sigmoid()
        biased = scores if correction_bias is None else scores + correction_bias.float()
        group_scores = biased.view(-1, spec.n_group, spec.num_experts // spec.n_group).topk(
            min(2, spec.num_experts // spec.n_group), dim=-1)[0].sum(dim=-1)
        ids = torch.topk(_keep_groups(biased, group_scores, spec, float("-inf")), spec.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    else:
        raise ValueError(f"router {spec.router!r} is unknown")
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-then-top-k. logits `[T, E]` -> (weights `[T, K]` fp32, ids `[T, K]` int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * scaling if scaling != 1.0 else weights), ids


def _keep_groups(scores: torch.Tensor, group_scores: torch.Tensor, spec: ModelSpec, fill: float) -> torch.Tensor:
    """scores `[T, E]` with every expert outside the topk_group best groups (group_scores `[T, G]`) set to
    fill."""
    best = torch.topk(group_scores, spec.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep[:, :, None].expand(-1, -1, spec.num_experts // spec.n_group).reshape(scores.shape)
    return scores.masked_fill(~keep, fill)
