"""Moving requests with their KV blocks from one attention rank to another: the one transfer behind the handover
of a leaving rank (attention_nodes/handover.py) and the prefill-to-decode move of PD (attention_nodes/pd.py).

A move is a msgpack description of the sequences (their tokens, progress, sampling state, which packed block
each holds) and one KV tensor of the distinct blocks, `[layers, c, n, block_size, heads, dim]`, of which the
receiver asks for the ones it needs once it has read the description (a receiver that caches some of them, or
cannot keep the KV at all, asks for fewer or none). `KVTransfer` is the interface; `GroupTransfer` sends both over
torch.distributed groups (gloo on CPU; the description and the indices always over the CPU control group, the
KV over the data group, where a CUDA build's NCCL takes device tensors). The transfer knows nothing of
sequences: the packing and unpacking are the attention side's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from . import p2p


class KVTransfer(Protocol):
    def send(self, meta: dict, kv: torch.Tensor, dst: int, between: Callable[[], None] | None = None,
             accepted: Callable[[], None] | None = None) -> list[int] | None:
        """meta (with "num_blocks" and "shape", the KV's) to attention rank dst, then the blocks of kv (dim 2) that
        dst asks for; returns their indices once sent, or None when dst refused the move (nothing more is sent).
        between(): called once meta is sent (a fault-injection point); accepted(): once dst has asked for the KV,
        before it goes."""

    def recv(self, src: int, wanted: Callable[[dict], list[int] | None] | None = None
             ) -> tuple[dict, torch.Tensor | None]:
        """What src sends: (meta, the KV blocks asked for, in that order, on this rank's device). wanted(meta) ->
        the block indices to ask for (None from it: refuse the move, and the KV is None; no wanted: every
        block)."""


class GroupTransfer:
    """KVTransfer over process groups: meta and the indices asked for by the control plane's send_object, kv by
    a point-to-point send on `group` (ranks are the world's: attention rank r is world rank r)."""

    def __init__(self, control, group, dtype: torch.dtype, device: torch.device):
        self.control, self.group, self.dtype, self.device = control, group, dtype, device

    def send(self, meta: dict, kv: torch.Tensor, dst: int, between: Callable[[], None] | None = None,
             accepted: Callable[[], None] | None = None) -> list[int] | None:
        self.control.send_object(meta, dst)
        if between is not None:
            between()
        need = self.control.recv_object(dst)
        if need is not None and accepted is not None:
            accepted()
        if need:
            p2p.send(kv if len(need) == kv.shape[2] else kv[:, :, need].contiguous(), dst, self.group)
        return need

    def recv(self, src: int, wanted: Callable[[dict], list[int] | None] | None = None
             ) -> tuple[dict, torch.Tensor | None]:
        meta = self.control.recv_object(src)
        need = list(range(meta["num_blocks"])) if wanted is None else wanted(meta)
        self.control.send_object(need, src)
        if need is None:
            return meta, None
        shape = list(meta["shape"])
        shape[2] = len(need)
        kv = torch.empty(shape, dtype=self.dtype, device=self.device)
        if need:
            p2p.recv(kv, src, self.group)
        return meta, kv
