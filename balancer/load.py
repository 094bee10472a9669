"""What an expert rank observes about its load: pairs served per (layer, slot) since the last re-placement
(the input of the placement EMA) and pairs per layer for each recent step (the max/mean statistic)."""
from __future__ import annotations

from collections import deque

import torch


class LoadTracker:
    def __init__(self, num_layers: int, num_slots: int, history: int = 1024):
        self.slot_counts = torch.zeros(num_layers, num_slots, dtype=torch.int64)
        self._step = torch.zeros(num_layers, dtype=torch.int64)
        self.history: deque[torch.Tensor] = deque(maxlen=history)

    def add(self, layer: int, slots: torch.Tensor) -> None:
        """slots `[N, K]` the received rows' slots on this rank (-1: the pair went elsewhere)."""
        valid = slots[slots >= 0].cpu()
        self.slot_counts[layer] += torch.bincount(valid, minlength=self.slot_counts.shape[1])
        self._step[layer] += valid.numel()

    def end_step(self) -> None:
        self.history.append(self._step.clone())
        self._step.zero_()

    def take_slot_counts(self) -> torch.Tensor:
        """`[L, S]` counts since the last call; resets them."""
        out = self.slot_counts.clone()
        self.slot_counts.zero_()
        return out

    def step_loads(self) -> torch.Tensor:
        """`[steps, L]` pairs per layer in each recorded step, oldest first."""
        if not self.history:
            return torch.zeros(0, self._step.numel(), dtype=torch.int64)
        return torch.stack(list(self.history))
