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
MEMBER_IDS = f"{PREFIX}/member_ids"   # the store's counter of member ids that ranks joining later draw from
HEARTBEAT_INTERVAL_S = 0.2

logger = logging.getLogger("afserve")


def draw_member_id(store) -> int:
    """A member id for a rank joining later, from the store's counter (past the first launch's ids, which its
    leader reserved): whoever draws it (the joiner itself, the leader for the front, the leader's own starter),
    no two members share one."""
    return int(store.add(MEMBER_IDS, 1))


BREAK_S = 1.0      # a rank still in a generation this long after a peer left it has its connections broken


class Heartbeat:
    """A daemon thread that bumps "afserve/hb/{member}" every HEARTBEAT_INTERVAL_S on its own store client, and
    watches for a rank wedged in its generation: once some member has left generation g to re-form the job,
    this rank's main thread should leave it too. A gloo point-to-point wait on a peer that has left (not died)
    can block until the collective timeout, because gloo does not always close a departed rank's connections
    (seen with two_phase: a source waiting for its node gateway's rows, after the gateway left). So after
    BREAK_S this thread calls interrupt(), which ends the rank's waits on its data plane (the generation's own
    connections shut down, its shm inbox marked aborted: the whole generation is being abandoned; nothing else
    of the process is touched); the wait raises a lost peer, and the rank re-forms like any other. If it is
    still in the generation after wedge_s, it exits, and the job re-forms without it (or, for the leader, ends
    at once rather than after the timeout). generations() -> (the generation this rank is in, the last one it
    has left).

    A rank that stops without dying (SIGSTOP, a hung host) keeps its process and its connections, so nothing
    above sees it. The leader's heartbeat therefore also watches the members of its generation (watch() -> their
    ids; empty on other ranks): one whose heartbeat count has not moved for failure_s is declared gone by
    marking the generation as being left, which sets the breaking above going on every rank; the re-forming's
    survey then finds it silent and leaves it out.

    A rank still forming generation g (forming() true: past the ready wait, not yet adopted) when another gave g
    up gets the same breaking, but never the exit: it may be reading expert weights from the checkpoint, which
    no connection ends and which can take longer than wedge_s, and the forming's own waits are bounded."""

    def __init__(self, host: str, port: int, member: int, generations: Callable[[], tuple[int, int]],
                 interrupt: Callable[[], int], watch: Callable[[], list[int]], failure_s: float, timeout_s: float,
                 wedge_s: float, forming: Callable[[], bool] = lambda: False):
        self.forming = forming
        self.key = f"{PREFIX}/hb/{member}"
        self.interrupt, self.watch, self.failure_s = interrupt, watch, failure_s
        self.member, self.generations, self.wedge_s = member, generations, wedge_s
        self.stop = threading.Event()
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.thread = threading.Thread(target=self._run, name=f"afserve-heartbeat-{member}", daemon=True)
        self.thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and wait for it (at most timeout_s): a daemon thread still inside a store call when
        the interpreter finalizes is ended by pthread_exit from the GIL's reacquisition, whose unwinding through
        the call's noexcept C++ frames aborts the process ("terminate called without an active exception", seen
        on rank 0 after a clean shutdown)."""
        self.stop.set()
        self.thread.join(timeout_s)

    def _run(self) -> None:
        since: tuple[int, float, bool] | None = None   # (generation, when its re-forming was seen, broken yet)
        beats: dict[int, tuple[int, int, float]] = {}   # member -> (generation, its count, when it last moved)
        while not self.stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.store.add(self.key, 1)
                gen, left = self.generations()
                if left < gen:
                    self._watch_members(gen, beats)
                if left >= gen or not self.store.check([f"{PREFIX}/g{gen}/leaving"]):
                    since = None
                    continue
            except Exception:      # the store's host (the leader) is gone: nothing left to tell
                return
            if since is None or since[0] != gen:
                since = (gen, time.monotonic(), False)
            elif not since[2] and time.monotonic() - since[1] > BREAK_S:
                since = (gen, since[1], True)
                if self.generations() == (gen, left):     # still in it (leaving takes far longer than this)
                    n = self.interrupt()
                    logger.warning("member %d: still in generation %d %.1fs after a peer left it; interrupted its "
                                   "data plane (%d connections shut down) so its waits end", self.member, gen,
                                   BREAK_S, n)
            elif time.monotonic() - since[1] > self.wedge_s and not self.forming():
                logger.error("member %d: still in generation %d %.0fs after a peer left it (wedged in an exchange "
                             "with a departed rank); exiting so the job re-forms without this rank",
                             self.member, gen, self.wedge_s)
                os._exit(70)

    def _watch_members(self, gen: int, beats: dict[int, tuple[int, int, float]]) -> None:
        """Leader: declare a member of generation gen gone once its heartbeat count has stood still for failure_s
        (marks the generation as being left; every rank's breaker then ends its waits)."""
        now = time.monotonic()
        for m in self.watch():
            count = self.store.add(f"{PREFIX}/hb/{m}", 0)
            last = beats.get(m)
            if last is None or last[0] != gen or last[1] != count:
                beats[m] = (gen, count, now)
            elif now - last[2] > self.failure_s and not self.store.check([f"{PREFIX}/g{gen}/leaving"]):
                logger.warning("member %d: heartbeat silent for %.1fs (stopped or hung, not dead); re-forming the "
                               "job without it", m, now - last[2])
                self.store.set(f"{PREFIX}/g{gen}/leaving", b"1")


DRAIN_S = 60.0     # drain_or_exit's own limit: a backstop behind the heartbeat's wedge check (wedge_s, 10 s+)


def stream_done(device) -> Callable[[], bool]:
    """Whether the work queued so far on `device`'s current stream has finished (asked again and again, never
    waiting): a CUDA event recorded now; on the CPU work is never queued."""
    if device.type != "cuda":
        return lambda: True
    import torch
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.query


def drain_or_exit(done: Callable[[], bool], deadline_s: float, member: int, exit: Callable[[int], None] = os._exit,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Leaving a generation: wait, polling done(), until the device has finished what this rank queued, so that
    the rank stays in the generation meanwhile. With cuda_ipc_events a stream may wait on a lost peer's CUDA IPC
    event that will never be recorded (the peer died between posting a round word and running its copy): no host
    call can cancel that wait and every later use of the device would block on it, so the rank must not go on to
    the next generation. Held here, the heartbeat's wedge check exits it (fail-stop, exit 70) once wedge_s has
    passed since the generation was given up, and the job re-forms without it (a leader's exit ends the job);
    past deadline_s, a backstop for a rank without a heartbeat, this exits it itself (71), as it does when the
    device reports an error."""
    end = clock() + deadline_s
    while True:
        try:
            if done():
                return
            why = f"has not finished its queued work {deadline_s:.0f}s after leaving its generation" \
                if clock() > end else None
        except Exception as e:      # the device itself failed (a CUDA error): nothing queued on it will finish
            why = f"failed while its queued work was awaited: {str(e).splitlines()[0][:200]}"
        if why is not None:
            logger.error("member %d: its device %s (a stream waiting on a lost peer's CUDA IPC event?); exiting so "
                         "the job re-forms without this rank", member, why)
            exit(71)
            return
        sleep(0.01)


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

    def count_here(self, members: list[int]) -> int:
        """How many of members run on this machine (the same host identity: hostname and boot id)."""
        return sum(self.proc(m)[0] == self.host for m in members)

    def process_gone(self, member: int) -> bool:
        """The member's process is on this host and has exited (a quicker verdict than a silent heartbeat)."""
        host, pid = self.proc(member)
        return host == self.host and not process_alive(pid)

    def beats(self, member: int) -> int:
        """The member's heartbeat count so far."""
        return self.store.add(f"{PREFIX}/hb/{member}", 0)

    def survey(self, members: list[int], checked_in: Callable[[int], dict | None], failure_s: float,
               timeout_s: float, first_loss: bool = False) -> tuple[dict[int, dict], list[int]]:
        """Wait until each of members has checked in (checked_in(m) -> its info, None while it has not:
        alive) or is known dead: its process is gone, or it has not heartbeaten for failure_s (lost); after
        timeout_s the silent ones count as lost. One found dead is asked once more whether it checked in (it may
        have just before it died, and others may have seen that). first_loss: return as soon as one is lost.
        Returns (alive: member -> info, lost)."""
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
                beat = None if self.process_gone(m) else self.beats(m)
                if beat is not None and (m not in seen or seen[m][0] != beat):
                    seen[m] = (beat, now)
                elif beat is None or now - seen[m][1] > failure_s or now > deadline:
                    info = checked_in(m)
                    if info is None:
                        lost.append(m)
                    else:
                        alive[m] = info
            if len(alive) + len(lost) == len(members) or (first_loss and lost):
                return alive, lost
            time.sleep(0.02)


def _socket_fds() -> dict[str, int]:
    """This process's open sockets: inode -> a descriptor of it (Linux /proc; empty elsewhere)."""
    found: dict[str, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[link[8:-1]] = int(fd)
    return found


def socket_inodes() -> set[str]:
    """The inodes of this process's open sockets (Linux /proc; empty elsewhere). Taken before and after a
    generation forms its groups, the difference is that generation's data-plane connections."""
    return set(_socket_fds())


def break_connections(inodes: set[str], store_port: int) -> int:
    """Shut down (both directions, without closing the descriptors) this process's established TCP connections
    among `inodes` (a generation's, from socket_inodes), never the store's (local or remote port store_port) ->
    how many. The peers' ends and this process's waits on them then fail as a lost peer does. Linux only."""
    import socket

    established = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
            ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
            if state == "01" and store_port not in ports and inode in inodes:      # 01: ESTABLISHED
                established.add(inode)
    count = 0
    for inode, fd in _socket_fds().items():
        if inode not in established:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.close()       # the duplicate only: the connection's own descriptor stays gloo's
    return count
