"""comm/p2p.py: sends, exchanges and gathers that any backend can carry. A tensor the group's backend cannot
carry (gloo: off the CPU, 'Bad address'; NCCL: off the GPU) goes through a copy on a device it can. On CPU the
staged path runs by forcing it; tests/gpu/test_cuda_failures.py runs it with CUDA tensors over gloo."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm import p2p
from tests.dist_utils import run_ranks


def _force_staging() -> None:
    """This child process only: every tensor goes through a host copy, as a CUDA tensor over gloo would."""
    p2p.wire = lambda tensor, group: torch.device("cpu")


def _sends(rank: int, world: int, force: bool) -> list[float]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if force:
        _force_staging()
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
    sums = run_ranks(_sends, 2, force)[1]
    assert sums == [66.0, 1266.0, 2466.0]


def _swap(rank: int, world: int, force: bool) -> tuple[list[float], int]:
    """Every rank sends two tensors to each other rank and receives theirs, in one exchange; the batch calls
    are counted."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if force:
        _force_staging()
    batches = []
    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: batches.append(len(ops)) or real(ops)
    peers = [r for r in range(world) if r != rank]
    sends = [(torch.full((4,), 10.0 * rank + k), peer) for peer in peers for k in range(2)]
    got = {(peer, k): torch.full((4,), float("nan")) for peer in peers for k in range(2)}
    p2p.exchange(sends, [(got[(peer, k)], peer) for peer in peers for k in range(2)])
    p2p.exchange([], [])          # nothing to move: no batch, no error
    return [float(got[(peer, k)][0]) for peer in peers for k in range(2)], batches


@pytest.mark.parametrize("force", [False, True])
def test_an_exchange_is_one_batch_and_messages_between_two_ranks_keep_their_order(force):
    """Ranks that each send to the others before receiving: one batch_isend_irecv per exchange (separate NCCL
    isend/irecv calls of such a swap deadlock), and the k-th message from a peer lands in the k-th receive
    from it."""
    (got0, batches0), (got1, batches1), (got2, _) = run_ranks(_swap, 3, force)
    assert got0 == [10.0, 11.0, 20.0, 21.0] and got1 == [0.0, 1.0, 20.0, 21.0] and got2 == [0.0, 1.0, 10.0, 11.0]
    assert batches0 == [8] and batches1 == [8]


def _gather(rank: int, world: int, force: bool) -> list[int]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if force:
        _force_staging()
    out = torch.full((world * 3,), -1, dtype=torch.int64)
    p2p.all_gather_into(out, torch.arange(3) + 10 * rank)
    return out.tolist()


@pytest.mark.parametrize("force", [False, True])
def test_all_gather_into_puts_each_rank_in_its_place(force):
    assert run_ranks(_gather, 2, force) == [[0, 1, 2, 10, 11, 12]] * 2


def test_what_each_backend_carries():
    """gloo carries host memory, NCCL this rank's GPU: a tensor elsewhere is copied to the device named."""
    cpu, cuda, gpu = torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda", 3)
    assert p2p.wire_device("gloo", cpu) is None
    assert p2p.wire_device("gloo", cuda) == cpu
    assert p2p.wire_device("nccl", cuda, lambda: gpu) is None
    assert p2p.wire_device("nccl", cpu, lambda: gpu) == gpu


def _wire_of_group(rank: int, world: int) -> tuple:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return p2p.wire(torch.empty(2), None), p2p.wire(torch.empty(2, device="meta"), dist.group.WORLD)


def test_off_cpu_tensors_go_through_host_memory_over_gloo():
    assert run_ranks(_wire_of_group, 1) == [(None, torch.device("cpu"))]
