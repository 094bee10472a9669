"""Point-to-point sends, exchanges and gathers of a rank's tensors over any process group.

Each backend carries one kind of memory. gloo moves host memory only: its send and recv hand the tensor's
pointer to the socket, so a CUDA tensor fails ("writev ...: Bad address", seen on an H100 when a re-formed job
moved expert weights between ranks sharing the GPU, whose groups are gloo). NCCL moves the memory of the rank's
GPU only. A tensor the group's backend cannot carry travels through a copy on the device it can (`wire`).
Start-up and membership changes use these (expert weights, handed-over KV blocks), and the balancer's per-layer
count gather; the step's data plane has its own transports.

`SideGroup` is a gloo group of a few ranks outside every generation's groups (ranks retiring from a job and ranks
joining it), formed on the job's store; the functions below take it as `group` too."""
from __future__ import annotations

from collections.abc import Callable
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


def current_gpu() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def wire_device(backend: str, device: torch.device, gpu: Callable[[], torch.device] = current_gpu
                ) -> torch.device | None:
    """Where a tensor on `device` must be copied to travel over a group of `backend`, or None when it travels as
    it is: gloo carries host memory, NCCL the memory of this rank's GPU (gpu(): the one set_device chose)."""
    if backend == "gloo":
        return None if device.type == "cpu" else torch.device("cpu")
    if backend == "nccl":
        return None if device.type == "cuda" else gpu()
    return None


def wire(tensor: torch.Tensor, group) -> torch.device | None:
    """wire_device for `tensor` over `group` (None: the default group)."""
    return wire_device("gloo" if isinstance(group, SideGroup) else dist.get_backend(group), tensor.device)


def _isend(tensor: torch.Tensor, dst: int, group):
    return group.isend(tensor, dst) if isinstance(group, SideGroup) else dist.isend(tensor, dst, group=group)


def _irecv(tensor: torch.Tensor, src: int, group):
    return group.irecv(tensor, src) if isinstance(group, SideGroup) else dist.irecv(tensor, src, group=group)


def _carried(tensor: torch.Tensor, group) -> torch.Tensor:
    """What a send hands to the backend: tensor itself, or its copy on the wire's device."""
    via = wire(tensor, group)
    return tensor.detach() if via is None else tensor.detach().to(via, copy=True)


def _landing(tensor: torch.Tensor, group) -> torch.Tensor:
    """Where a receive into `tensor` lands: tensor itself, or a buffer on the wire's device (copied in after)."""
    via = wire(tensor, group)
    return tensor if via is None else torch.empty(tensor.shape, dtype=tensor.dtype, device=via)


class _Posted:
    """Posted sends and receives: wait() waits for them all, then copies each staged receive into its tensor.
    Holds the staged send copies until then."""

    def __init__(self, works: list, carried: list[torch.Tensor], landed: list[tuple[torch.Tensor, torch.Tensor]]):
        self.works, self.carried, self.landed = works, carried, landed

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        for target, buf in self.landed:
            if buf is not target:
                target.copy_(buf)


def isend(tensor: torch.Tensor, dst: int, group=None) -> _Posted:
    """dist.isend that any backend can carry -> a handle with wait()."""
    carried = _carried(tensor, group)
    return _Posted([_isend(carried, dst, group)], [carried], [])


def irecv(tensor: torch.Tensor, src: int, group=None) -> _Posted:
    """dist.irecv into `tensor` that any backend can carry -> a handle whose wait() leaves the data in it."""
    buf = _landing(tensor, group)
    return _Posted([_irecv(buf, src, group)], [], [(tensor, buf)])


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    irecv(tensor, src, group).wait()


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group=None) -> None:
    """One exchange's sends [(tensor, dst)] and receives [(tensor, src)], posted together and waited for; each
    receive lands in its tensor, and messages between two ranks match in the order they are listed. Over a
    registered group they go in one batch_isend_irecv: NCCL runs separate isend/irecv calls in issue order on
    one stream, so two ranks that each send to the other before receiving would each wait for a receive queued
    behind the peer's own send. A SideGroup's (gloo, whose sends do not wait for the receive) are posted one by
    one."""
    carried = [(_carried(t, group), dst) for t, dst in sends]
    landed = [(t, _landing(t, group), src) for t, src in recvs]
    if isinstance(group, SideGroup):
        works = [group.isend(c, d) for c, d in carried] + [group.irecv(b, s) for _, b, s in landed]
    else:
        ops = ([dist.P2POp(dist.isend, c, d, group) for c, d in carried]
               + [dist.P2POp(dist.irecv, b, s, group) for _, b, s in landed])
        works = dist.batch_isend_irecv(ops) if ops else []
    _Posted(works, [c for c, _ in carried], [(t, b) for t, b, _ in landed]).wait()


ASK = object()      # all_gather_into's via: not known yet, ask wire()


def all_gather_into(out: torch.Tensor, mine: torch.Tensor, group=None, via=ASK) -> None:
    """dist.all_gather_single that any backend can carry: every rank's `mine` into `out`, in group order. via:
    wire(mine, group) when the caller knows it already (a per-layer caller decides it once), else asked here."""
    if via is ASK:
        via = wire(mine, group)
    if via is None:
        dist.all_gather_single(out, mine, group=group)
        return
    buf = torch.empty(out.shape, dtype=out.dtype, device=via)
    dist.all_gather_single(buf, mine.to(via), group=group)
    out.copy_(buf)
