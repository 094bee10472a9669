"""The expert slots one expert rank holds, loaded straight from the checkpoint.

Names: L MoE layers, S slots on this rank, H hidden, I expert intermediate size.
"""
from __future__ import annotations

import logging

import torch

from comm import p2p
from kernels import ops
from kernels.moe import SILU, ExpertAct
from models.checkpoint import Checkpoint, dequantize_mxfp4

logger = logging.getLogger(__name__)


class ExpertSlots:
    """w13 `[L, S, 2I, H]` (gate rows, then up rows), w2 `[L, S, H, I]`; slot2expert `[L, S]` int64, -1 = empty;
    b13 `[L, S, 2I]` and b2 `[L, S, H]` where the experts have biases (GPT-OSS), else None; act: the FFN's
    activation. Empty slots stay zero and are never addressed. kernel_backend: the resolved `kernels.ops`
    backend of ffn."""

    def __init__(self, slot2expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, kernel_backend: str = "torch",
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, act: ExpertAct = SILU):
        self.slot2expert, self.w13, self.w2 = slot2expert, w13, w2
        self.b13, self.b2, self.act = b13, b2, act
        self.kernel_backend = kernel_backend

    @classmethod
    def load(cls, ckpt: Checkpoint, slot2expert: torch.Tensor, dtype: torch.dtype, device: torch.device,
             desc: str = "", kernel_backend: str = "torch", progress=None) -> ExpertSlots:
        """Read only the experts named in slot2expert `[L, S]`."""
        slots = cls.empty(ckpt, slot2expert, dtype, device, kernel_backend)
        slots._read(ckpt, slot2expert, desc, progress)
        logger.info("%s loaded %d expert slots", desc, int((slot2expert >= 0).sum()))
        return slots

    @classmethod
    def empty(cls, ckpt: Checkpoint, slot2expert: torch.Tensor, dtype: torch.dtype, device: torch.device,
              kernel_backend: str = "torch") -> ExpertSlots:
        """Zero weights shaped for slot2expert `[L, S]` (filled by _read or adopt)."""
        spec = ckpt.spec
        L, S = slot2expert.shape
        I, H = spec.moe_intermediate_size, spec.hidden_size
        w13 = torch.zeros(L, S, 2 * I, H, dtype=dtype, device=device)
        w2 = torch.zeros(L, S, H, I, dtype=dtype, device=device)
        act = ExpertAct(spec.expert_act, spec.swiglu_alpha, spec.swiglu_limit)
        b13 = b2 = None
        if spec.fused_experts:
            b13 = torch.zeros(L, S, 2 * I, dtype=dtype, device=device)
            b2 = torch.zeros(L, S, H, dtype=dtype, device=device)
        return cls(slot2expert.clone(), w13, w2, kernel_backend, b13, b2, act)

    @staticmethod
    def bytes_per_slot(ckpt: Checkpoint, dtype: torch.dtype) -> int:
        """Bytes one slot's weights take (per MoE layer, summed over layers)."""
        spec = ckpt.spec
        I, H = spec.moe_intermediate_size, spec.hidden_size
        per_layer = 3 * I * H + (2 * I + H if spec.fused_experts else 0)
        return per_layer * spec.num_moe_layers * dtype.itemsize

    def _read(self, ckpt: Checkpoint, wanted: torch.Tensor, desc: str = "", progress=None) -> int:
        """Read from the checkpoint the experts named in wanted `[L, S]` (-1 = leave the slot alone) into their
        slots; returns how many slots were read."""
        spec = ckpt.spec
        I = spec.moe_intermediate_size
        if spec.fused_experts:
            for li, layer in enumerate(spec.moe_layer_ids):
                _load_fused_layer(ckpt, layer, wanted[li], self.w13[li], self.w2[li], self.b13[li], self.b2[li])
            return int((wanted >= 0).sum())
        todo = []
        for li, layer in enumerate(spec.moe_layer_ids):
            for slot, e in enumerate(wanted[li].tolist()):
                if e >= 0:
                    todo.append((li, slot, spec.expert_tensor_names(layer, e)))
        if not todo:
            return 0
        tensors = ckpt.read([n for _, _, names in todo for n in names], dtype=self.w13.dtype,
                            device=self.w13.device, desc=desc, progress=progress)
        for li, slot, (gate, up, down) in todo:
            self.w13[li, slot, :I] = tensors[gate]
            self.w13[li, slot, I:] = tensors[up]
            self.w2[li, slot] = tensors[down]
        return len(todo)

    def adopt(self, ckpt: Checkpoint, moves: list[tuple[int, int, int, int, int]], slot2expert: torch.Tensor,
              me: int, world_rank, group=None, staged: dict | None = None) -> tuple[ExpertSlots, int, int]:
        """This rank's part of a membership change: new slots for slot2expert `[L, S']` (S' may differ from
        the current S). moves: every rank's (layer, dst rank, dst slot, src rank, src slot) in expert-pool
        ranks of the new pool (balancer/replan.py; src -1 = the checkpoint), the same list on every rank;
        world_rank maps them to ranks of `group`, where this rank's old slots are still held by it. Returns
        (the new slots, slots received from peers, slots read from the checkpoint). staged: (layer, new slot) ->
        the tensors of an expert a retiring rank sent before it left, used instead of the checkpoint."""
        new = ExpertSlots.empty(ckpt, slot2expert, self.w13.dtype, self.w13.device, self.kernel_backend)
        width = min(self.num_slots, new.num_slots)
        for t_new, t_old in zip(new._per_slot(), self._per_slot()):   # experts that stay in their slot
            same = (self.slot2expert[:, :width] == slot2expert[:, :width]) & (slot2expert[:, :width] >= 0)
            t_new[:, :width][same] = t_old[:, :width][same]
        received, wanted = self._carry(moves, me, new, world_rank, group)
        for (layer, slot), bufs in (staged or {}).items():
            for t, b in zip(new._per_slot(), bufs):
                t[layer, slot] = b
            wanted[layer, slot] = -1
            received += 1
        read = new._read(ckpt, wanted) if bool((wanted >= 0).any()) else 0
        return new, received, read

    def move(self, moves: list[tuple[int, int, int, int, int]], slot2expert: torch.Tensor, me: int,
             world_rank, group=None) -> int:
        """Carry out this rank's part of a re-placement between steps. moves: every rank's (layer, dst rank,
        dst slot, src rank, src slot), in the same order on every rank (expert-pool rank numbers);
        world_rank maps them to ranks of `group`. Copies within this rank, sends what peers need from here
        and receives what arrives, then adopts slot2expert `[L, S]`. Returns the number of slots received."""
        received, _ = self._carry(moves, me, self, world_rank, group)
        self.slot2expert = slot2expert.clone()
        return received

    def _carry(self, moves, me: int, into: ExpertSlots, world_rank, group) -> tuple[int, torch.Tensor]:
        """This rank's part of moves (layer, dst rank, dst slot, src rank, src slot) from this rank's slots
        into `into`'s (this object itself for a move in place): copies within the rank, sends what peers need
        and receives what arrives. Returns (slots received, `[L, S']` the experts whose source is the
        checkpoint (src -1) at their slots, -1 elsewhere): the caller reads those."""
        landed, received, from_checkpoint = self.exchange(moves, me, world_rank, group)
        for (layer, dslot), bufs in landed.items():
            for t, b in zip(into._per_slot(), bufs):
                t[layer, dslot] = b
        wanted = torch.full_like(into.slot2expert, -1)
        for layer, dslot in from_checkpoint:
            wanted[layer, dslot] = into.slot2expert[layer, dslot]
        return received, wanted

    def exchange(self, moves, me: int, world_rank, group) -> tuple[dict, int, list[tuple[int, int]]]:
        """This rank's part of moves (layer, dst rank, dst slot, src rank, src slot; src -1 = the checkpoint):
        sends what peers need from its slots, receives what arrives for it and copies what moves within it ->
        ((layer, dst slot) -> the expert's tensors that land there, how many came from peers, the (layer, dst
        slot) whose source is the checkpoint). Nothing of this object changes."""
        sends, recvs, landed, received, from_checkpoint = [], [], {}, 0, []
        for layer, dst, dslot, src, sslot in moves:
            if dst == me:
                if src == -1:
                    from_checkpoint.append((layer, dslot))
                elif src == me:   # copy now: a later write may overwrite the source slot
                    landed[(layer, dslot)] = [t[layer, sslot].clone() for t in self._per_slot()]
                else:
                    bufs = [t.new_empty(t.shape[2:]) for t in self._per_slot()]   # S may be 0 (a joiner)
                    recvs += [(b, world_rank(src)) for b in bufs]
                    landed[(layer, dslot)] = bufs
                    received += 1
            elif src == me:
                sends += [(t[layer, sslot], world_rank(dst)) for t in self._per_slot()]
        p2p.exchange(sends, recvs, group)    # one batch: ranks swapping experts both send first
        return landed, received, from_checkpoint

    def _per_slot(self) -> list[torch.Tensor]:
        """Every `[L, S, ...]` tensor a slot's expert occupies (a move carries each)."""
        return [t for t in (self.w13, self.w2, self.b13, self.b2) if t is not None]

    @property
    def num_slots(self) -> int:
        return self.slot2expert.shape[1]

    def num_bytes(self) -> int:
        """Bytes of expert weights this rank holds."""
        return sum(t.numel() * t.element_size() for t in self._per_slot())

    def ffn(self, moe_layer: int, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[N, H]`, slots `[N, K]` (-1 = elsewhere), weights `[N, K]` -> weighted expert sum `[N, H]`."""
        b13 = None if self.b13 is None else self.b13[moe_layer]
        b2 = None if self.b2 is None else self.b2[moe_layer]
        return ops.fused_moe(x, slots, weights, self.w13[moe_layer], self.w2[moe_layer], self.kernel_backend,
                             b13=b13, b2=b2, act=self.act)


def _load_fused_layer(ckpt: Checkpoint, layer: int, slot2expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      b13: torch.Tensor, b2: torch.Tensor) -> None:
    """GPT-OSS: read this rank's experts' rows of one layer's fused tensors into its slots. gate_up `[E, H, 2I]`
    holds gate and up interleaved along its last dim (gate at even columns); down `[E, I, H]`; MXFP4
    checkpoints hold `*_blocks` / `*_scales` instead, dequantized here."""
    spec = ckpt.spec
    names = spec.fused_expert_names(layer)
    slots = [s for s, e in enumerate(slot2expert.tolist()) if e >= 0]
    experts = [int(slot2expert[s]) for s in slots]
    if not slots:
        return

    def weight(role: str) -> torch.Tensor:   # -> fp32 [n, in, out]
        if spec.mxfp4_experts:
            return dequantize_mxfp4(ckpt.read_rows(names[role + "_blocks"], experts),
                                    ckpt.read_rows(names[role + "_scales"], experts))
        return ckpt.read_rows(names[role], experts).float()

    gate_up, down = weight("gate_up"), weight("down")
    gate_up_bias = ckpt.read_rows(names["gate_up_bias"], experts).float()
    idx = torch.tensor(slots, device=w13.device)
    w13[idx] = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=-1).transpose(1, 2).to(w13)
    w2[idx] = down.transpose(1, 2).to(w2)
    b13[idx] = torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), dim=-1).to(b13)
    b2[idx] = ckpt.read_rows(names["down_bias"], experts).to(b2)
