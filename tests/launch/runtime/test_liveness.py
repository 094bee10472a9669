"""Peers.survey, the wait that decides which members of a generation are alive: on a store of its own, with
members whose processes really ran on this host (one still running, one exited). Generations._agree. A process
whose heartbeat was closed exits cleanly however busy the heartbeat's store calls are."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import msgpack
import torch.distributed as dist

from comm.shm import host_identity
from launch.runtime.changes import MembershipSettings
from launch.runtime.generations import Generations
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


def _generations(store: dist.Store, member: int):
    """A member's Generations on the test's store, without a runtime or a heartbeat thread (_agree needs neither)."""
    gens = Generations.__new__(Generations)
    gens.store, gens.member = store, member
    gens.settings = MembershipSettings(failure_s=2.0, collective_timeout_s=60.0, startup_timeout_s=60.0,
                                       expert_memory=None)
    gens._peers = Peers(store, member)
    return gens


def _votes(store: dist.Store, votes: dict[int, bool], members: list[int]) -> dict[int, bool]:
    """Each member of votes calls _agree(5, members, its vote) in a thread of its own, while a heartbeat thread
    keeps every voter alive -> what each was told (a vote still waiting after 10 s fails the test)."""
    told: dict[int, bool] = {}
    gens = {m: _generations(store, m) for m in votes}
    done = threading.Event()

    def beat():
        while not done.wait(0.1):
            for m in votes:
                store.add(f"{PREFIX}/hb/{m}", 1)
    threads = [threading.Thread(target=lambda m=m: told.__setitem__(m, gens[m]._agree(5, members, votes[m])),
                                daemon=True) for m in votes]
    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    done.set()
    assert not any(t.is_alive() for t in threads), f"votes {votes} of members {members} still waiting"
    return told


def test_a_generation_forms_for_every_member_or_for_none():
    """Generations._agree, the decision that a generation formed once its groups and weights are in: all members
    that have their weights -> formed for all; a member whose process is gone before it reported -> failed for
    the others at once (found by the survey, while the live ones still wait for a decision); one member that
    failed -> failed for all, and a member reporting its weights after that is told failed too, never formed."""
    store = dist.HashStore()
    assert _votes(store, {0: True, 1: True, 2: True}, [0, 1, 2]) == {0: True, 1: True, 2: True}

    store = dist.HashStore()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _register(store, 2, gone.pid)
    assert _votes(store, {0: True, 1: True}, [0, 1, 2]) == {0: False, 1: False}
    assert store.get(f"{PREFIX}/g5/outcome") == b"failed"

    store = dist.HashStore()
    assert _votes(store, {1: False}, [0, 1]) == {1: False}
    assert store.get(f"{PREFIX}/g5/leaving") == b"1"     # members still in an exchange get interrupted
    assert _votes(store, {0: True}, [0, 1]) == {0: False}


EXIT_AFTER_CLOSE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from launch.procs import free_port
from launch.runtime import liveness
liveness.HEARTBEAT_INTERVAL_S = 0.0     # the thread is inside a store call nearly all the time
port = free_port()
master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
hb = liveness.Heartbeat("127.0.0.1", port, 0, lambda: (0, 0), lambda: 0, lambda: [], 5.0, 10.0, 60.0)
time.sleep(0.2)
hb.close()
sys.exit(0)
"""


def test_a_process_exits_cleanly_after_its_heartbeat_closes():
    """The heartbeat thread is a daemon in store calls: had close() not waited for it, the interpreter's
    finalization would end it inside a call and abort the process ("terminate called without an active
    exception", exit -6; a rank that had shut down cleanly failed its torchrun job that way)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", EXIT_AFTER_CLOSE], cwd=root, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_leaving_a_generation_waits_for_the_device_and_exits_if_it_never_finishes():
    """drain_or_exit polls until the device's queued work is done; a stream that never finishes (one waiting on
    a lost peer's CUDA IPC event) makes the rank exit once the deadline has passed, not hang."""
    import torch

    from launch.runtime.liveness import drain_or_exit, stream_done
    clock, exits, polls = FakeClock(), [], iter([False] * 5 + [True])
    drain_or_exit(lambda: next(polls), 1.0, 7, exit=exits.append, clock=clock, sleep=clock.sleep)
    assert exits == [] and 0.04 < clock.t < 0.06          # five polls 10 ms apart, then done
    clock = FakeClock()
    drain_or_exit(lambda: False, 1.0, 7, exit=exits.append, clock=clock, sleep=clock.sleep)
    assert exits == [71] and 1.0 < clock.t < 1.02          # gave up just past the deadline, once

    def failed():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    drain_or_exit(failed, 1.0, 7, exit=exits.append, clock=clock, sleep=clock.sleep)
    assert exits == [71, 71]                                # a device error: exits at once, no traceback
    assert stream_done(torch.device("cpu"))()               # the CPU queues nothing
