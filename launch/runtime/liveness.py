"""Telling a live rank from a dead one: every rank's heartbeat thread, and the store records of where each
member's process runs. Store keys (under "afserve/"): "hb/{member}" (a counter the heartbeat bumps),
"proc/{member}" ([host identity, pid], written once at start-up)."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import msgpack
import torch.distributed as dist

from comm.shm import host_identity, process_alive

PREFIX = "afserve"
HEARTBEAT_INTERVAL_S = 0.2

logger = logging.getLogger("afserve")


class Heartbeat:
    """A daemon thread that bumps "afserve/hb/{member}" every HEARTBEAT_INTERVAL_S on its own store client, and
    watches for a rank wedged in its generation: once some member has left generation g to re-form the job,
    this rank's main thread has wedge_s to leave it too. A gloo point-to-point wait on a peer that has left
    (not died) can block until the collective timeout, because gloo does not always close a departed rank's
    connections (seen with two_phase); such a rank exits instead, and the job re-forms without it (or, for
    the leader, ends at once rather than after the timeout). generations() -> (the generation this rank is
    in, the last one it has left)."""

    def __init__(self, host: str, port: int, member: int, generations: Callable[[], tuple[int, int]],
                 timeout_s: float, wedge_s: float):
        self.key = f"{PREFIX}/hb/{member}"
        self.member, self.generations, self.wedge_s = member, generations, wedge_s
        self.stop = threading.Event()
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.thread = threading.Thread(target=self._run, name=f"afserve-heartbeat-{member}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        since: tuple[int, float] | None = None       # (generation, when its re-forming was first seen)
        while not self.stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.store.add(self.key, 1)
                gen, left = self.generations()
                if left >= gen or not self.store.check([f"{PREFIX}/g{gen}/leaving"]):
                    since = None
                    continue
            except Exception:      # the store's host (the leader) is gone: nothing left to tell
                return
            if since is None or since[0] != gen:
                since = (gen, time.monotonic())
            elif time.monotonic() - since[1] > self.wedge_s:
                logger.error("member %d: still in generation %d %.0fs after a peer left it (wedged in an exchange "
                             "with a departed rank); exiting so the job re-forms without this rank",
                             self.member, gen, self.wedge_s)
                os._exit(70)


class Peers:
    """The members' processes as the store records them: register this one, look up the others."""

    def __init__(self, store: dist.Store, member: int):
        self.store = store
        self.host = host_identity()
        self.procs: dict[int, list] = {}   # member -> [host identity, pid], as read from the store
        store.set(f"{PREFIX}/proc/{member}", msgpack.packb([self.host, os.getpid()]))

    def proc(self, member: int) -> list:
        """[host identity, pid] of a member's process (written once at its start-up: read once)."""
        if member not in self.procs:
            self.procs[member] = msgpack.unpackb(self.store.get(f"{PREFIX}/proc/{member}"))
        return self.procs[member]

    def hostname(self, member: int) -> str:
        """The host a member runs on, as that host sees its own name."""
        return self.proc(member)[0].partition("/")[0]

    def process_gone(self, member: int) -> bool:
        """The member's process is on this host and has exited (a quicker verdict than a silent heartbeat)."""
        host, pid = self.proc(member)
        return host == self.host and not process_alive(pid)

    def beats(self, member: int) -> int:
        """The member's heartbeat count so far."""
        return self.store.add(f"{PREFIX}/hb/{member}", 0)

    def survey(self, members: list[int], checked_in: Callable[[int], dict | None], failure_s: float,
               timeout_s: float) -> tuple[dict[int, dict], list[int]]:
        """Wait until each of members has checked in (checked_in(m) -> its info, None while it has not:
        alive) or is known dead: its process is gone, or it has not heartbeaten for failure_s (lost); after
        timeout_s the silent ones count as lost. Returns (alive: member -> info, lost)."""
        alive: dict[int, dict] = {}
        lost: list[int] = []
        seen: dict[int, tuple[int, float]] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            for m in members:
                if m in alive or m in lost:
                    continue
                info = checked_in(m)
                if info is not None:
                    alive[m] = info
                    continue
                if self.process_gone(m):
                    lost.append(m)
                    continue
                beat = self.beats(m)
                if m not in seen or seen[m][0] != beat:
                    seen[m] = (beat, now)
                elif now - seen[m][1] > failure_s or now > deadline:
                    lost.append(m)
            if len(alive) + len(lost) == len(members):
                return alive, lost
            time.sleep(0.02)
