"""comm/p2p.py: point-to-point sends that gloo can carry. Over gloo a tensor off the CPU goes through a host
copy (gloo hands the pointer to the socket: a CUDA pointer fails with 'Bad address'). On CPU the staged path
runs by forcing it; tests/gpu/test_cuda_failures.py runs it with CUDA tensors."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm import p2p
from tests.dist_utils import run_ranks


def _exchange(rank: int, world: int, force: bool) -> list[float]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if force:
        p2p.staged = lambda tensor, group: True      # this child process only
    data = [torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * k for k in range(3)]
    if rank == 0:
        works = [p2p.isend(t, 1) for t in data]
        p2p.send(data[0] * -1, 1)
        for w in works:
            w.wait()
        return []
    got = [torch.full((3, 4), float("nan")) for _ in data]
    works = [p2p.irecv(t, 0) for t in got]
    for w in works:
        w.wait()
    last = torch.empty(3, 4)
    p2p.recv(last, 0)
    assert all(torch.equal(g, d) for g, d in zip(got, data))
    assert torch.equal(last, -data[0])
    return [float(g.sum()) for g in got]


@pytest.mark.parametrize("force", [False, True])
def test_sends_arrive_whole_in_order(force):
    sums = run_ranks(_exchange, 2, force)[1]
    assert sums == [66.0, 1266.0, 2466.0]


def _staged_by_device(rank: int, world: int) -> tuple[bool, bool]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return p2p.staged(torch.empty(2), None), p2p.staged(torch.empty(2, device="meta"), dist.group.WORLD)


def test_off_cpu_tensors_go_through_host_memory_over_gloo():
    assert run_ranks(_staged_by_device, 1) == [(False, True)]
