"""Shared-memory inbox: slots keyed by round, early wake-ups harmless, a dead sender noticed fast."""
from __future__ import annotations

import subprocess
import threading
import time

import pytest
import torch

from comm.shm import Inbox, Outlet, _StoreFence


def test_rounds_and_payloads(tmp_path):
    inbox = Inbox(str(tmp_path), rank=1, num_senders=2, depth=2, slot_bytes=48)
    out = [Outlet(str(tmp_path), 1, _StoreFence(), sender, depth=2, slot_bytes=48) for sender in range(2)]
    # Round 2 arrives from sender 1 before round 1 is complete: still read in order.
    out[0].send(1, torch.arange(4, dtype=torch.uint8), 4)
    out[1].send(2, torch.full((3,), 9, dtype=torch.uint8), 3)
    out[1].send(1, torch.full((2,), 7, dtype=torch.uint8), 2)
    slots = inbox.wait(1, 5, "test")
    assert slots[0][0] == 4 and slots[0][1][:4].tolist() == [0, 1, 2, 3]
    assert slots[1][0] == 2 and slots[1][1][:2].tolist() == [7, 7]
    out[0].send(2, torch.zeros(0, dtype=torch.uint8), 0)
    slots = inbox.wait(2, 5, "test")
    assert slots[1][0] == 3 and slots[1][1][:3].tolist() == [9, 9, 9]
    with pytest.raises(RuntimeError, match="exceeds the 48-byte slot"):
        out[0].send(3, torch.zeros(49, dtype=torch.uint8), 49)


def test_dead_sender_is_reported_quickly(tmp_path):
    inbox = Inbox(str(tmp_path), rank=0, num_senders=1, depth=2, slot_bytes=32)
    proc = subprocess.Popen(["sleep", "0"])
    proc.wait()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 3 died before sending round 1"):
        inbox.wait(1, 60, "test", [proc.pid], ["rank 3"])
    assert time.monotonic() - t0 < 3
    with pytest.raises(RuntimeError, match="rank 3 sent nothing for round 1 within 0.2s"):
        inbox.wait(1, 0.2, "test", None, ["rank 3"])


def test_a_peer_leaving_the_generation_wakes_a_waiting_inbox_at_once(tmp_path):
    """Outlet.abort (a peer re-forming the job) makes a wait raise PeerLost without waiting out its timeout,
    though the sender is alive and no round arrives."""
    import threading

    from comm.failures import PeerLost, is_peer_failure

    inbox = Inbox(str(tmp_path), rank=0, num_senders=1, depth=2, slot_bytes=32)
    out = Outlet(str(tmp_path), 0, _StoreFence(), 0, depth=2, slot_bytes=32)
    out.send(1, torch.zeros(0, dtype=torch.uint8), 0)
    inbox.wait(1, 5, "test")
    timer = threading.Timer(0.3, out.abort)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="a peer left the job to re-form it") as info:
        inbox.wait(2, 60, "test", [__import__("os").getpid()], ["rank 1"])
    assert 0.25 < time.monotonic() - t0 < 5
    assert is_peer_failure(info.value)


def test_the_allocator_publishes_the_payload_before_the_round_word(tmp_path):
    """The same Inbox/Outlet logic runs with another allocator (cuda_ipc's waits for its copies in publish):
    publish is called after the payload is written and before the round word a receiver polls."""
    from comm.shm import CudaIpcBuffers, HostShmBuffers, slot_buffers

    seen = []

    class Recording(HostShmBuffers):
        def publish(self):
            seen.append((inbox._flag(0, 1, 0), inbox.slot(0, 1)[:3].tolist()))

    inbox = Inbox(str(tmp_path), rank=0, num_senders=1, depth=2, slot_bytes=16, buffers=Recording())
    out = Outlet(str(tmp_path), 0, _StoreFence(), 0, depth=2, slot_bytes=16, buffers=Recording(),
                 export=inbox.export)
    out.send(1, torch.tensor([5, 6, 7], dtype=torch.uint8), 3)
    assert seen == [(-1, [5, 6, 7])]           # payload in place, round not yet published
    assert inbox.wait(1, 5, "test")[0][0] == 3
    assert type(slot_buffers(torch.device("cpu"))) is HostShmBuffers
    assert type(slot_buffers(torch.device("cuda", 0))) is CudaIpcBuffers


def test_each_slot_is_signalled_after_its_payload_and_awaited_before_it_is_read(tmp_path):
    """The slot signals (cuda_ipc_events: a CUDA IPC event per sender and slot, made by the receiver and opened by
    the sender) go through the same Inbox/Outlet code with an allocator whose signals are names: the inbox hands
    them out in its export, each sender picks its own, signals its slot's once the payload is in place and before
    the round word, and the receiver awaits every sender's signal for that round, after the round words and before
    it reads the slots; over depth + 1 rounds a slot's signal is reused."""
    from comm.shm import HostShmBuffers

    depth, log = 2, []

    class Named(HostShmBuffers):
        def allocate(self, path, nbytes, num_signals):
            buf, _, export = super().allocate(path, nbytes, num_signals)
            names = [f"sig{i}" for i in range(num_signals)]
            return buf, names, names

        def open(self, path, export):
            return super().open(path, export)[0], export

        def signal(self, sig):
            log.append(("signal", sig, inbox._flag(senders.index(sig_owner[sig]), rnd, 0), bytes(payload_of(sig))))

        def await_signal(self, sig):
            log.append(("await", sig, [inbox._flag(s, rnd, 0) for s in range(2)]))

    inbox = Inbox(str(tmp_path), rank=0, num_senders=2, depth=depth, slot_bytes=8, buffers=Named())
    senders = [Outlet(str(tmp_path), 0, _StoreFence(), s, depth, 8, Named(), inbox.export) for s in range(2)]
    sig_owner = {sig: out for out in senders for sig in out.signals}
    payload_of = lambda sig: inbox.slot(senders.index(sig_owner[sig]), rnd)[:2].tolist()   # noqa: E731
    assert [out.signals for out in senders] == [["sig0", "sig1"], ["sig2", "sig3"]]
    for rnd in (1, 2, 3):
        waiting = []      # the receiver waits before anything is sent: its awaits must follow the round words
        receiver = threading.Thread(target=lambda: waiting.append(inbox.wait(rnd, 5, "test")))
        receiver.start()
        time.sleep(0.05)
        for s, out in enumerate(senders):
            out.send(rnd, torch.tensor([rnd, s], dtype=torch.uint8), 2)
        receiver.join(5)
        (got,) = waiting
        assert [slot[:2].tolist() for _, slot in got] == [[rnd, 0], [rnd, 1]]
        mine = [f"sig{s * depth + rnd % depth}" for s in range(2)]
        previous = rnd - depth if rnd > depth else -1    # the slot's round word before this round's
        assert log == [("signal", mine[0], previous, bytes([rnd, 0])), ("signal", mine[1], previous, bytes([rnd, 1])),
                       ("await", mine[0], [rnd, rnd]), ("await", mine[1], [rnd, rnd])], (rnd, log)
        log.clear()


def test_ipc_events_need_one_setting_and_one_gpu():
    from comm.shm import ipc_events_refusal

    assert ipc_events_refusal([(False, 0), (False, 1)]) is None      # the synchronize works across GPUs
    assert ipc_events_refusal([(True, 0), (True, 0), (True, 0)]) is None
    assert "ranks [1] only" in ipc_events_refusal([(False, 0), (True, 0)])
    assert "GPUs [0, 1]" in ipc_events_refusal([(True, 0), (True, 1)])


def test_a_fan_out_waits_for_its_copies_once_before_any_round_word(tmp_path):
    """ShmDispatcher._send: every payload is written, then one publish (cuda_ipc: one stream synchronize per
    dispatch or combine, not one per peer), then the round words."""
    from types import SimpleNamespace

    from comm.shm import HostShmBuffers
    from comm.shm_dispatcher import ShmDispatcher

    seen = []

    class Recording(HostShmBuffers):
        def publish(self):
            seen.append([(ib._flag(0, 1, 0), ib.slot(0, 1)[:2].tolist()) for ib in inboxes])

    inboxes = [Inbox(str(tmp_path), rank=r, num_senders=1, depth=2, slot_bytes=8) for r in range(2)]
    outlets = [Outlet(str(tmp_path), r, _StoreFence(), 0, depth=2, slot_bytes=8) for r in range(2)]
    rows = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.uint8)
    ShmDispatcher._send(SimpleNamespace(outlets=outlets, buffers=Recording()), 1, rows.split([1, 2]))
    assert seen == [[(-1, [1, 2]), (-1, [3, 4])]]       # one wait, both payloads in place, no round yet
    assert [ib.wait(1, 5, "test")[0][0] for ib in inboxes] == [1, 2]
    assert inboxes[1].slot(0, 1)[:4].tolist() == [3, 4, 5, 6]


def test_a_process_reaped_while_its_stat_is_read_counts_as_dead(monkeypatch):
    """process_alive opens /proc/PID/stat and reads it; a process reaped in between makes the read raise
    ProcessLookupError (seen in the chaos soak: the leader's survey died of it). That is a dead process, not an
    error; a live one (this process) and a zombie's stat line keep their answers."""
    import io

    from comm import shm

    class Reaped(io.StringIO):
        def read(self, *args):
            raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(shm, "open", lambda path: Reaped(), raising=False)
    assert shm.process_alive(12345) is False
    monkeypatch.setattr(shm, "open", lambda path: io.StringIO("7 (a (b) c) Z 1 2"), raising=False)
    assert shm.process_alive(7) is False
    monkeypatch.setattr(shm, "open", lambda path: io.StringIO("7 (python) S 1 2"), raising=False)
    assert shm.process_alive(7) is True
    monkeypatch.undo()
    import os
    assert shm.process_alive(os.getpid()) is True
