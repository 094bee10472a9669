"""The expert slots one expert rank holds, loaded straight from the checkpoint.

Names: L MoE layers, S slots on this rank, H hidden, I expert intermediate size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kernels import ops
from models.checkpoint import Checkpoint


class ExpertSlots:
    """w13 `[L, S, 2I, H]` (gate rows, then up rows), w2 `[L, S, H, I]`; slot2expert `[L, S]` int64, -1 = empty.
    Empty slots stay zero and are never addressed. kernel_backend: the resolved `kernels.ops` backend of ffn."""

    def __init__(self, slot2expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, kernel_backend: str = "torch"):
        self.slot2expert, self.w13, self.w2 = slot2expert, w13, w2
        self.kernel_backend = kernel_backend

    @classmethod
    def load(cls, ckpt: Checkpoint, slot2expert: torch.Tensor, dtype: torch.dtype, device: torch.device,
             desc: str = "", kernel_backend: str = "torch", progress=None) -> ExpertSlots:
        """Read only the experts named in slot2expert `[L, S]`."""
        spec = ckpt.spec
        L, S = slot2expert.shape
        I, H = spec.moe_intermediate_size, spec.hidden_size
        w13 = torch.zeros(L, S, 2 * I, H, dtype=dtype, device=device)
        w2 = torch.zeros(L, S, H, I, dtype=dtype, device=device)
        wanted = []
        for li, layer in enumerate(spec.moe_layer_ids):
            for slot, e in enumerate(slot2expert[li].tolist()):
                if e >= 0:
                    wanted.append((li, slot, spec.expert_tensor_names(layer, e)))
        tensors = ckpt.read([n for _, _, names in wanted for n in names], dtype=dtype, device=device, desc=desc,
                            progress=progress)
        for li, slot, (gate, up, down) in wanted:
            w13[li, slot, :I] = tensors[gate]
            w13[li, slot, I:] = tensors[up]
            w2[li, slot] = tensors[down]
        return cls(slot2expert.clone(), w13, w2, kernel_backend)

    def move(self, moves: list[tuple[int, int, int, int, int]], slot2expert: torch.Tensor, me: int,
             world_rank, group=None) -> int:
        """Carry out this rank's part of a re-placement between steps. moves: every rank's (layer, dst rank,
        dst slot, src rank, src slot), in the same order on every rank (expert-pool rank numbers);
        world_rank maps them to ranks of `group`. Copies within this rank, sends what peers need from here
        and receives what arrives, then adopts slot2expert `[L, S]`. Returns the number of slots received."""
        works, landed, received = [], [], 0
        for layer, dst, dslot, src, sslot in moves:
            if dst == me:
                if src == me:   # copy now: a later write may overwrite the source slot
                    landed.append((layer, dslot, self.w13[layer, sslot].clone(), self.w2[layer, sslot].clone()))
                    continue
                b13, b2 = torch.empty_like(self.w13[layer, 0]), torch.empty_like(self.w2[layer, 0])
                works += [dist.irecv(b13, world_rank(src), group=group), dist.irecv(b2, world_rank(src), group=group)]
                landed.append((layer, dslot, b13, b2))
                received += 1
            elif src == me:
                works += [dist.isend(self.w13[layer, sslot], world_rank(dst), group=group),
                          dist.isend(self.w2[layer, sslot], world_rank(dst), group=group)]
        for w in works:
            w.wait()
        for layer, dslot, b13, b2 in landed:
            self.w13[layer, dslot] = b13
            self.w2[layer, dslot] = b2
        self.slot2expert = slot2expert.clone()
        return received

    @property
    def num_slots(self) -> int:
        return self.slot2expert.shape[1]

    def ffn(self, moe_layer: int, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[N, H]`, slots `[N, K]` (-1 = elsewhere), weights `[N, K]` -> weighted expert sum `[N, H]`."""
        return ops.fused_moe(x, slots, weights, self.w13[moe_layer], self.w2[moe_layer], self.kernel_backend)
