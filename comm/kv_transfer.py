"""Moving requests with their KV blocks from one attention rank to another: the one transfer behind the handover
of a leaving rank (attention_nodes/handover.py) and the prefill-to-decode move of PD (attention_nodes/pd.py).

A move is a msgpack description of the sequences (their tokens, progress, sampling state, which packed block
each holds) and one KV tensor of the distinct blocks, `[layers, c, n, block_size, heads, dim]`. `KVTransfer` is
the interface; `GroupTransfer` sends both over torch.distributed groups (gloo on CPU; the description always
over the CPU control group, the KV over the data group, where a CUDA build's NCCL takes device tensors). The
transfer knows nothing of sequences: the packing and unpacking are the attention side's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from . import p2p


class KVTransfer(Protocol):
    def send(self, meta: dict, kv: torch.Tensor, dst: int, between: Callable[[], None] | None = None) -> None:
        """meta (with "num_blocks" and "shape", the KV's) and kv to attention rank dst; returns when sent.
        between(): called once meta is sent, before the KV (a fault-injection point)."""

    def recv(self, src: int) -> tuple[dict, torch.Tensor]:
        """What src sent: (meta, kv on this rank's device)."""


class GroupTransfer:
    """KVTransfer over process groups: meta by the control plane's send_object, kv by a point-to-point send on
    `group` (ranks are the world's: attention rank r is world rank r)."""

    def __init__(self, control, group, dtype: torch.dtype, device: torch.device):
        self.control, self.group, self.dtype, self.device = control, group, dtype, device

    def send(self, meta: dict, kv: torch.Tensor, dst: int, between: Callable[[], None] | None = None) -> None:
        self.control.send_object(meta, dst)
        if between is not None:
            between()
        if meta["num_blocks"]:
            p2p.send(kv, dst, self.group)

    def recv(self, src: int) -> tuple[dict, torch.Tensor]:
        meta = self.control.recv_object(src)
        kv = torch.empty(meta["shape"], dtype=self.dtype, device=self.device)
        if meta["num_blocks"]:
            p2p.recv(kv, src, self.group)
        return meta, kv
