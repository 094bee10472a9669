"""Point-to-point sends of a rank's device tensors over any process group.

gloo moves host memory only: its send and recv hand the tensor's pointer to the socket, so a CUDA tensor fails
("writev ...: Bad address", seen on an H100 when a re-formed job moved expert weights between ranks sharing
the GPU, whose groups are gloo). Over a gloo group a tensor that is not on the CPU therefore travels through
a host copy; NCCL, and gloo with CPU tensors, take the tensor as it is. Start-up and membership changes use
these (expert weights, handed-over KV blocks); the step's data plane has its own transports.

`SideGroup` is a gloo group of a few ranks outside every generation's groups (ranks retiring from a job and ranks
joining it), formed on the job's store; the functions below take it as `group` too."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class SideGroup:
    """A gloo process group of `size` ranks formed on `store` under `prefix`, not registered with
    torch.distributed (its members need not be in any group): point-to-point only. Forming it waits at most
    timeout_s for every member, then raises."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)
        self.rank, self.size = rank, size

    def isend(self, tensor: torch.Tensor, dst: int):
        return self.pg.send([tensor], dst, 0)

    def irecv(self, tensor: torch.Tensor, src: int):
        return self.pg.recv([tensor], src, 0)


def staged(tensor: torch.Tensor, group) -> bool:
    """Whether `tensor` must go through host memory over `group` (None: the default group)."""
    return tensor.device.type != "cpu" and (isinstance(group, SideGroup) or dist.get_backend(group) == "gloo")


def _isend(tensor: torch.Tensor, dst: int, group):
    return group.isend(tensor, dst) if isinstance(group, SideGroup) else dist.isend(tensor, dst, group=group)


def _irecv(tensor: torch.Tensor, src: int, group):
    return group.irecv(tensor, src) if isinstance(group, SideGroup) else dist.irecv(tensor, src, group=group)


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
        return _HostSend(_isend(host, dst, group), host)
    return _isend(tensor, dst, group)


def irecv(tensor: torch.Tensor, src: int, group=None):
    """dist.irecv into `tensor` that any backend can carry -> a handle whose wait() leaves the data in it."""
    if staged(tensor, group):
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return _HostRecv(_irecv(host, src, group), host, tensor)
    return _irecv(tensor, src, group)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    irecv(tensor, src, group).wait()
