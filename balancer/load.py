"""What an expert rank observes about its load: pairs served per (layer, slot) since the last re-placement
(the input of the placement EMA) and pairs per layer for each recent step (the max/mean statistic).

Names: L MoE layers, S slots on this rank, H steps of history."""
from __future__ import annotations

import torch


class LoadTracker:
    """Counts on `device`, where the received rows are: `add` and `end_step` never read to the host (the decode
    path does not wait on it); `take_slot_counts` and `step_loads` copy to the host when the runtime asks (at
    re-placement, for stats). slot_counts `[L, S]` int64; the last H steps' loads sit in a ring `[H, L]` int64."""

    def __init__(self, num_layers: int, num_slots: int, history: int = 1024, device: torch.device | str = "cpu"):
        self.slot_counts = torch.zeros(num_layers, num_slots, dtype=torch.int64, device=device)
        self._step = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self._ring = torch.zeros(history, num_layers, dtype=torch.int64, device=device)
        self._num_steps = 0     # steps ended so far; step i sits in ring row i % H

    def add(self, layer: int, slots: torch.Tensor) -> None:
        """slots `[N, K]` int64 the received rows' slots on this rank (-1: the pair went elsewhere)."""
        flat = slots.reshape(-1)
        served = (flat >= 0).to(torch.int64)
        # a fixed-size scatter, weighted so the -1 pairs (clamped onto slot 0) add nothing
        self.slot_counts[layer].scatter_add_(0, flat.clamp(min=0), served)
        self._step[layer] += served.sum()

    def end_step(self) -> None:
        self._ring[self._num_steps % self._ring.shape[0]].copy_(self._step)
        self._step.zero_()
        self._num_steps += 1

    def take_slot_counts(self) -> torch.Tensor:
        """`[L, S]` int64 on the host: counts since the last call; resets them."""
        out = self.slot_counts.to("cpu", copy=True)
        self.slot_counts.zero_()
        return out

    def step_loads(self) -> torch.Tensor:
        """`[steps, L]` int64 on the host: pairs per layer in each recorded step (at most H), oldest first."""
        H = self._ring.shape[0]
        kept = min(self._num_steps, H)
        rows = (torch.arange(kept, device=self._ring.device) + self._num_steps - kept) % H
        return self._ring[rows].to("cpu", copy=True)
