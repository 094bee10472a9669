"""One expert rank's step: for every MoE layer, receive rows, run the grouped FFN, send results back."""
from __future__ import annotations

import torch

from balancer.load import LoadTracker
from comm.dispatcher import Dispatcher

from .slots import ExpertSlots


class ExpertWorker:
    def __init__(self, rank: int, slots: ExpertSlots, dispatcher: Dispatcher, num_moe_layers: int,
                 micro_batches: int = 1, num_mtp_layers: int = 0):
        """num_moe_layers: the target's and the MTP layers' (ModelSpec.num_moe_layers); the last num_mtp_layers are
        the MTP layers', served in a step's draft passes (attention_nodes/mtp.py)."""
        self.rank, self.slots, self.dispatcher = rank, slots, dispatcher
        self.num_moe_layers, self.num_mtp_layers = num_moe_layers, num_mtp_layers
        self.micro_batches = micro_batches
        self.load = LoadTracker(num_moe_layers, slots.num_slots, device=slots.w13.device)
        self.multi_pass_steps = 0     # steps served with several PD decode passes

    def adopt(self, slots: ExpertSlots, dispatcher: Dispatcher) -> None:
        """A new generation of the job: serve these slots through its dispatcher (load counts start over)."""
        self.slots, self.dispatcher = slots, dispatcher
        self.load = LoadTracker(self.num_moe_layers, slots.num_slots, device=slots.w13.device)

    def detach(self) -> None:
        """This rank left its generation: drop the data plane (the next generation brings its own)."""
        self.dispatcher = None

    def move_experts(self, moves: list[tuple[int, int, int, int, int]], slot2expert: torch.Tensor, me: int,
                     world_rank, group) -> int:
        """A live re-placement: copy, send and receive the slots that change (ExpertSlots.move) -> slots
        received."""
        return self.slots.move(moves, slot2expert, me, world_rank, group)

    @torch.inference_mode()
    def step(self, capacity: int, micro_batches: int = 1, draft_passes: int = 0, before_drafts=None,
             passes: int = 1, before_pass=None) -> None:
        """Serve one engine step: per MoE layer of the target, the dispatches of every micro-batch, then for each
        in turn the grouped FFN and its combine (the attention ranks issue the collectives in the same order), all
        that once per decode pass (PD, attention_nodes/passes.py); then the MTP layers' MoE once per draft pass
        (pass j: MTP layer j mod num_mtp_layers, one micro-batch). capacity: the step header's bound on any
        attention rank's tokens; micro_batches: the header's number of micro-batches this step (at most the
        configured one, which sized the data plane). before_drafts: called between the target's layers and the
        draft passes, before_pass: before each decode pass after the first (fault injection)."""
        assert 1 <= micro_batches <= self.micro_batches, (micro_batches, self.micro_batches)
        assert not draft_passes or self.num_mtp_layers, "draft passes without MTP layers"
        self.dispatcher.set_capacity(capacity)
        self.multi_pass_steps += passes > 1
        first_mtp = self.num_moe_layers - self.num_mtp_layers
        layers = [(layer, micro_batches) for _ in range(passes) for layer in range(first_mtp)]
        layers += [(first_mtp + j % self.num_mtp_layers, 1) for j in range(draft_passes)]
        for n, (layer, rounds) in enumerate(layers):
            if 0 < n < passes * first_mtp and n % first_mtp == 0 and before_pass is not None:
                before_pass()
            if n == passes * first_mtp and before_drafts is not None:
                before_drafts()
            pending = [self.dispatcher.start_dispatch(layer, *self.dispatcher.empty_tokens()) for _ in range(rounds)]
            for p in pending:
                rows, handle = self.dispatcher.finish_dispatch(p)
                self.load.add(layer, rows.slots)
                t0 = self.dispatcher.stats.now()
                out = self.slots.ffn(layer, rows.hidden, rows.slots, rows.weights)
                self.dispatcher.stats.add_compute(layer, t0, self.dispatcher.stats.now())
                self.dispatcher.combine(out, handle)
        self.load.end_step()
