"""Point-to-point sends of a rank's device tensors over any process group.

gloo moves host memory only: its send and recv hand the tensor's pointer to the socket, so a CUDA tensor fails
("writev ...: Bad address", seen on an H100 when a re-formed job moved expert weights between ranks sharing
the GPU, whose groups are gloo). Over a gloo group a tensor that is not on the CPU therefore travels through
a host copy; NCCL, and gloo with CPU tensors, take the tensor as it is. Start-up and membership changes use
these (expert weights, handed-over KV blocks); the step's data plane has its own transports."""
from __future__ import annotations

import torch
import torch.distributed as dist


def staged(tensor: torch.Tensor, group) -> bool:
    """Whether `tensor` must go through host memory over `group` (None: the default group)."""
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


class _HostRecv:
    """A receive into a host buffer: wait() copies it into the device tensor once it has arrived."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor):
        self.work, self.host, self.target = work, host, target

    def wait(self) -> None:
        self.work.wait()
        self.target.copy_(self.host)


class _HostSend:
    """A send from a host copy, kept alive until the send completes."""

    def __init__(self, work, host: torch.Tensor):
        self.work, self.host = work, host

    def wait(self) -> None:
        self.work.wait()


def isend(tensor: torch.Tensor, dst: int, group=None):
    """dist.isend that any backend can carry -> a handle with wait()."""
    if staged(tensor, group):
        host = tensor.detach().to("cpu")
        return _HostSend(dist.isend(host, dst, group=group), host)
    return dist.isend(tensor, dst, group=group)


def irecv(tensor: torch.Tensor, src: int, group=None):
    """dist.irecv into `tensor` that any backend can carry -> a handle whose wait() leaves the data in it."""
    if staged(tensor, group):
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return _HostRecv(dist.irecv(host, src, group=group), host, tensor)
    return dist.irecv(tensor, src, group=group)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    irecv(tensor, src, group).wait()
