"""Expert placement: which expert each physical slot of each expert rank holds.

Names: L MoE layers, E logical experts, R expert ranks, S slots per rank,
phy = physical slot id = rank * S + slot (rank counted within the expert pool).
Pure tensors, no torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Placement:
    """slot2expert: `[L, R, S]` int64, the logical expert in each slot, -1 = empty slot."""

    slot2expert: torch.Tensor
    num_experts: int

    def __post_init__(self) -> None:
        assert self.slot2expert.dim() == 3, self.slot2expert.shape
        per_layer = [torch.unique(layer[layer >= 0]).numel() for layer in self.slot2expert]
        if any(n != self.num_experts for n in per_layer):
            raise ValueError(f"placement must hold every one of {self.num_experts} experts in each layer; "
                             f"per layer it holds {per_layer}")

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_ranks: int) -> Placement:
        """One replica per expert, contiguous blocks: rank r holds experts [r*S, (r+1)*S)."""
        if num_ranks < 1 or num_ranks > num_experts:
            raise ValueError(f"need 1 <= expert ranks ({num_ranks}) <= num_experts ({num_experts}); "
                             f"use at most {num_experts} expert ranks")
        num_slots = -(-num_experts // num_ranks)
        flat = torch.full((num_ranks * num_slots,), -1, dtype=torch.int64)
        # Spread the remainder so ranks differ by at most one expert.
        base, extra = divmod(num_experts, num_ranks)
        e = 0
        for r in range(num_ranks):
            n = base + (1 if r < extra else 0)
            flat[r * num_slots:r * num_slots + n] = torch.arange(e, e + n)
            e += n
        return cls(flat.view(1, num_ranks, num_slots).repeat(num_layers, 1, 1), num_experts)

    @property
    def num_layers(self) -> int:
        return self.slot2expert.shape[0]

    @property
    def num_ranks(self) -> int:
        return self.slot2expert.shape[1]

    @property
    def num_slots(self) -> int:
        return self.slot2expert.shape[2]

    def log2phy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log2phy `[L, E, max_replicas]` int64 phy ids, -1 = padding; replica_count `[L, E]` int64)."""
        L, E = self.num_layers, self.num_experts
        flat = self.slot2expert.view(L, -1)
        count = torch.zeros(L, E, dtype=torch.int64)
        for layer in range(L):
            valid = flat[layer] >= 0
            count[layer] = torch.bincount(flat[layer][valid], minlength=E)
        max_rep = int(count.max())
        out = torch.full((L, E, max_rep), -1, dtype=torch.int64)
        for layer in range(L):
            phy = torch.nonzero(flat[layer] >= 0).flatten()
            experts = flat[layer][phy]
            order = torch.argsort(experts, stable=True)
            phy, experts = phy[order], experts[order]
            # rank of each replica among its expert's replicas
            starts = torch.cumsum(count[layer], 0) - count[layer]
            idx = torch.arange(phy.numel()) - starts[experts]
            out[layer, experts, idx] = phy
        return out, count
