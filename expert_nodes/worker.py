"""One expert rank's step: for every MoE layer, receive rows, run the grouped FFN, send results back."""
from __future__ import annotations

import torch

from comm.dispatcher import Dispatcher

from .slots import ExpertSlots


class ExpertWorker:
    def __init__(self, rank: int, slots: ExpertSlots, dispatcher: Dispatcher, num_moe_layers: int):
        self.rank, self.slots, self.dispatcher = rank, slots, dispatcher
        self.num_moe_layers = num_moe_layers
        self.num_rows_served = 0

    @torch.inference_mode()
    def step(self, capacity: int) -> None:
        """Serve one engine step: one dispatch + combine per MoE layer, in layer order.
        capacity: the step header's bound on any attention rank's tokens."""
        self.dispatcher.set_capacity(capacity)
        for layer in range(self.num_moe_layers):
            rows, handle = self.dispatcher.dispatch(layer, *self.dispatcher.empty_tokens())
            out = self.slots.ffn(layer, rows.hidden, rows.slots, rows.weights)
            self.num_rows_served += rows.hidden.shape[0]
            self.dispatcher.combine(out, handle)
