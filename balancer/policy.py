"""Replica choice: map each (token, expert) to one physical slot.

Policies sit behind `ReplicaPolicy`; they are pure tensor functions (no torch.distributed),
so the runtime and the tests call them the same way.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .placement import Placement


class ReplicaPolicy(ABC):
    """Chooses a replica for every routed (token, expert) pair of one MoE layer."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self.log2phy, self.replica_count = placement.log2phy()

    @abstractmethod
    def choose(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids: `[T, K]` int64 logical experts -> `[T, K]` int64 phy ids (rank * S + slot)."""


class StaticPolicy(ReplicaPolicy):
    """Always the first replica of each expert (with identity placement: the expert's only copy)."""

    def choose(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        table = self.log2phy[layer, :, 0].to(topk_ids.device)
        return table[topk_ids]


POLICIES: dict[str, type[ReplicaPolicy]] = {"static": StaticPolicy}


def make_policy(name: str, placement: Placement) -> ReplicaPolicy:
    if name not in POLICIES:
        raise ValueError(f"balancer {name!r} is not available; choose one of {sorted(POLICIES)}")
    return POLICIES[name](placement)
