"""Peers.survey, the wait that decides which members of a generation are alive: on a store of its own, with
members whose processes really ran on this host (one still running, one exited)."""
from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import torch.distributed as dist

from comm.shm import host_identity
from launch.runtime.liveness import PREFIX, Peers


def _register(store: dist.Store, member: int, pid: int) -> None:
    store.set(f"{PREFIX}/proc/{member}", msgpack.packb([host_identity(), pid]))


def test_a_member_found_dead_that_checked_in_just_before_counts_as_alive():
    """Member 1's process has exited; it checked in (marked itself ready) just before, which the survey's first
    look missed. Other members may have seen that mark and gone on to form the generation, so this one must
    count member 1 as checked in, not lost: the survey asks once more after finding it dead. Member 2 exited
    without checking in: lost. Member 3 checks in at the first look."""
    store = dist.HashStore()
    peers = Peers(store, 0)
    gone = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    for p in gone:
        p.wait()
    _register(store, 1, gone[0].pid)
    _register(store, 2, gone[1].pid)
    _register(store, 3, os.getpid())
    looks = {1: 0, 2: 0}

    def checked_in(m: int) -> dict | None:
        if m == 3:
            return {"role": "expert"}
        looks[m] += 1
        return {"role": "attention"} if m == 1 and looks[m] > 1 else None   # member 1: seen from the second look

    alive, lost = peers.survey([1, 2, 3], checked_in, failure_s=5.0, timeout_s=10.0)
    assert alive == {1: {"role": "attention"}, 3: {"role": "expert"}}
    assert lost == [2]
    assert looks == {1: 2, 2: 2}
