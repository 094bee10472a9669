"""Same-host data plane: inboxes in memory that the ranks of one host share. One class serves two transports,
which differ only in where a slot's payload lives (the allocator): host shared memory between CPU ranks
(`shm`), or device memory shared through CUDA IPC handles between GPU ranks (`cuda_ipc`), which also lets
several ranks share one GPU, where NCCL refuses them.

With three or more rank processes on a few cores, every gloo collective costs ~1 ms of thread hand-offs
(measured on the 2-core CI box: all_to_all of 8 bytes 1.2 ms with 3 ranks, 0.28 ms with 2). Here each
rank owns an inbox: per sender and per round in flight, a slot's flags [round int64 | count int64] in a
host shared-memory file, its payload from the allocator, and a FIFO that senders write one byte to after
filling a slot.
A receiver checks its slots' round words, polls them for up to SPIN_S (yielding the core between looks, so
another process that is ready runs), and only then blocks on the FIFO. A sender writes the wake-up byte only
when the receiver says it sleeps (a word in its inbox; sender and receiver each store, fence, then load, so
one of them always sees the other), which saves a system call and a wake-up of an idle core per message:
on the 2-core VM the wake-ups alone took ~10% of both ranks' time. Wake-ups that arrive early for a later
round are harmless. Rounds follow the call order, which is the same on
every rank, so no sizes or sequence numbers are exchanged. The inbox ends with an abort word: a rank that
leaves the job's current generation (to re-form it after a failure) sets it in each peer's inbox and wakes
the peer, whose wait then raises `PeerLost` at once instead of waiting out its timeout.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import select
import time

import torch

from .failures import PeerLost

HEADER = 16  # a slot's flags: round (int64) + count (int64)
TAIL_WORDS = 2  # int64 words after the slots' flags: SLEEP (the receiver blocks on its FIFO), ABORT
SLEEP, ABORT = -2, -1  # non-zero while the receiver sleeps / once a peer has left the generation
LIVENESS_S = 0.1  # a wait silent this long checks that its missing senders' processes still exist
SPIN_S = 0.002  # a wait polls this long (yielding the core) before it sleeps on the FIFO


class _StoreFence:
    """A full memory barrier between the payload copy and the round word, so a reader that sees the new round
    also sees the payload (large copies may use non-temporal stores). A locked instruction orders them:
    lock and unlock a private pthread spinlock."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None)
        self.lock = ctypes.c_int(0)
        self.libc.pthread_spin_init(ctypes.byref(self.lock), 0)

    def __call__(self) -> None:
        self.libc.pthread_spin_lock(ctypes.byref(self.lock))
        self.libc.pthread_spin_unlock(ctypes.byref(self.lock))


def shm_supported() -> bool:
    """Linux on x86-64: total store order makes the reader's plain loads safe without a fence."""
    return os.uname().sysname == "Linux" and os.uname().machine in ("x86_64", "AMD64")


def process_alive(pid: int) -> bool:
    """Same-host process liveness (a zombie counts as dead; so does one reaped between opening its stat file and
    reading it, where the read raises ProcessLookupError: seen once in the chaos soak, where it ended the leader)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def host_identity() -> str:
    """Hostname plus boot id: equal only for processes on the same running machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


def _place(sender: int, rnd: int, depth: int) -> int:
    """Which of an inbox's slots (sender, round) uses: slots are laid out [sender][round % depth]."""
    return sender * depth + rnd % depth


def _slot(buf: torch.Tensor, sender: int, rnd: int, depth: int, slot_bytes: int) -> torch.Tensor:
    """The slot of (sender, round) in an inbox's payloads laid out as [sender][round % depth][slot_bytes]."""
    start = _place(sender, rnd, depth) * slot_bytes
    return buf[start:start + slot_bytes]


def _flag(sender: int, rnd: int, depth: int) -> int:
    """Index of the round word of (sender, round) in an inbox's int64 flags [sender][round % depth][round,
    count]; its count follows it."""
    return _place(sender, rnd, depth) * 2


class HostShmBuffers:
    """Slot payloads in host shared memory: a file (in the job's shared directory) that every peer maps. The
    flags' fence orders a sender's payload stores before its round word, so publish and the slots' signals have
    nothing to do.

    The allocator interface (CudaIpcBuffers implements it too): `allocate` an inbox's payloads and one signal per
    (sender, slot); `open` a peer inbox's; `publish` after a sender's copies, before its round words; `signal`
    a slot's signal once its payload is written, before its round word; `await_signal` on the receiver, after
    the round word, before it reads the slot."""

    device = torch.device("cpu")

    def allocate(self, path: str, nbytes: int, num_signals: int) -> tuple[torch.Tensor, list, object]:
        """-> (this process's view of a new zeroed buffer, its slots' signals (none here), what a peer needs to
        open it: nothing, the path)."""
        return _map(path, nbytes, create=True), [None] * num_signals, None

    def open(self, path: str, export: object) -> tuple[torch.Tensor, list | None]:
        """A peer inbox's payloads and its slots' signals (None: none)."""
        return _map(path, 0, create=False), None

    def publish(self) -> None:
        pass

    def signal(self, sig) -> None:
        pass

    def await_signal(self, sig) -> None:
        pass


class CudaIpcBuffers:
    """Slot payloads in device memory, shared with the peers of one host through CUDA IPC handles (torch's
    own tensor sharing, as torch.multiprocessing pickles a CUDA tensor). A sender's copies into a peer's slot
    are enqueued on its stream, and a peer that sees the round word must read them finished. Two ways:
    - events=False: publish synchronizes the stream before the round words go out (the host waits for the
      device once per dispatch or combine);
    - events=True: each (sender, slot) has an interprocess CUDA event (`torch.cuda.Event(interprocess=True)`,
      made by the receiver, opened by the sender from its IPC handle); the sender records it on its stream after
      its copies, before the round word, and the receiver's stream waits for it before reading the slot, so
      neither host waits for a device.
    Either way a receiver's reads of a slot stay ahead of the next write to it: a slot is re-used `depth` rounds
    later, only after the receiver has answered, and the answer is ordered after its reads (synchronized, or
    recorded on the same stream after them and waited for by the sender's stream before its next writes)."""

    def __init__(self, device: torch.device, events: bool = False):
        self.device, self.events = device, events

    def allocate(self, path: str, nbytes: int, num_signals: int) -> tuple[torch.Tensor, list, object]:
        from torch.multiprocessing.reductions import reduce_tensor

        buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        signals = [torch.cuda.Event(interprocess=True) if self.events else None for _ in range(num_signals)]
        with torch.cuda.device(self.device):
            handles = [e.ipc_handle() for e in signals] if self.events else None
        return buf, signals, (reduce_tensor(buf), handles)

    def open(self, path: str, export: object) -> tuple[torch.Tensor, list | None]:
        (rebuild, args), handles = export
        if (handles is not None) != self.events:
            raise RuntimeError(f"cuda_ipc_events differs between ranks (this rank: {self.events}): every rank of "
                               "the job must be launched with the same setting")
        signals = None if handles is None else [torch.cuda.Event.from_ipc_handle(self.device, h) for h in handles]
        return rebuild(*args), signals

    def publish(self) -> None:
        if not self.events:
            torch.cuda.current_stream(self.device).synchronize()

    def signal(self, sig) -> None:
        if sig is not None:
            sig.record(torch.cuda.current_stream(self.device))

    def await_signal(self, sig) -> None:
        if sig is not None:
            torch.cuda.current_stream(self.device).wait_event(sig)


def ipc_events_refusal(ranks: list[tuple[bool, int]]) -> str | None:
    """Why the ranks' (cuda_ipc_events, GPU index) settings cannot run (None: they can): every rank must choose the
    same, and with events all must be on one GPU (a sender records the receiver's event on its own stream, which
    CUDA allows only on the event's device)."""
    chosen = {e for e, _ in ranks}
    if len(chosen) > 1:
        on = [r for r, (e, _) in enumerate(ranks) if e]
        return f"cuda_ipc_events is on for ranks {on} only: launch every rank with the same setting"
    gpus = sorted({g for _, g in ranks})
    if chosen == {True} and len(gpus) > 1:
        return (f"cuda_ipc_events needs every rank on one GPU, but the ranks use GPUs {gpus}: turn it off "
                "(--no-cuda-ipc-events) or place the ranks on one GPU")
    return None


def slot_buffers(device: torch.device, events: bool = False) -> HostShmBuffers | CudaIpcBuffers:
    """The allocator of a rank's inbox payloads on `device`: host shared memory on CPU, CUDA IPC on a GPU (events:
    slots signalled through CUDA IPC events, not a stream synchronize; CudaIpcBuffers)."""
    return CudaIpcBuffers(device, events) if device.type == "cuda" else HostShmBuffers()


def _map(path: str, size: int, create: bool) -> torch.Tensor:
    """A uint8 view of a shared file: created (O_EXCL) with `size` zero bytes, or opened whole."""
    return torch.frombuffer(_mmap(path, size, create), dtype=torch.uint8)


def _map_words(path: str, size: int, create: bool) -> memoryview:
    """The int64 words of a shared file (as `_map`): plain 8-byte loads and stores, ~20x cheaper from Python
    than indexing a tensor."""
    return memoryview(_mmap(path, size, create)).cast("q")


def _mmap(path: str, size: int, create: bool) -> mmap.mmap:
    if create:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        os.ftruncate(fd, max(size, 1))
    else:
        fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, os.fstat(fd).st_size)
    os.close(fd)
    return mm


class Inbox:
    """This rank's inbox: `num_senders` x `depth` slots of `slot_bytes` payload each. Their flags ([round,
    count] int64 per slot, then the abort word) live in host shared memory; their payloads where `buffers`
    puts them (host shared memory, or device memory shared through CUDA IPC). `export`: what a peer's
    Outlet needs to open the payloads. name: its files' stem in the directory (a rank may own several inboxes)."""

    def __init__(self, directory: str, rank: int, num_senders: int, depth: int, slot_bytes: int,
                 buffers: HostShmBuffers | CudaIpcBuffers | None = None, name: str | None = None):
        self.num_senders, self.depth, self.slot_bytes = num_senders, depth, slot_bytes
        self.buffers = buffers = buffers or HostShmBuffers()
        stem = os.path.join(directory, name or f"rank{rank}")
        self.path, self.fifo_path = f"{stem}.buf", f"{stem}.fifo"
        self.flags = _map_words(self.path, num_senders * depth * HEADER + TAIL_WORDS * 8, create=True)
        self.data, self.signals, self.export = buffers.allocate(f"{stem}.data", num_senders * depth * slot_bytes,
                                                                num_senders * depth)
        for i in range(0, num_senders * depth * 2, 2):
            self.flags[i] = -1
        self.fence = _StoreFence()
        os.mkfifo(self.fifo_path, 0o600)
        self.fifo = os.open(self.fifo_path, os.O_RDWR | os.O_NONBLOCK)  # RDWR: never EOF, never blocks on open

    def slot(self, sender: int, rnd: int) -> torch.Tensor:
        return _slot(self.data, sender, rnd, self.depth, self.slot_bytes)

    def interrupt(self) -> None:
        """From another thread of this rank: end its waits as a peer's abort does (they raise PeerLost)."""
        self.flags[ABORT] = 1
        with contextlib.suppress(OSError):
            os.write(self.fifo, b"\x01")

    def _flag(self, sender: int, rnd: int, word: int) -> int:
        return self.flags[_flag(sender, rnd, self.depth) + word]

    def _missing(self, rnd: int, what: str) -> list[int]:
        if self.flags[ABORT]:
            raise PeerLost(f"{what}: a peer left the job to re-form it (round {rnd})")
        return [s for s in range(self.num_senders) if self._flag(s, rnd, 0) != rnd]

    def wait(self, rnd: int, timeout_s: float, what: str, sender_pids: list[int] | None = None,
             sender_names: list[str] | None = None) -> list[tuple[int, torch.Tensor]]:
        """Block until every sender has filled its slot for round rnd -> (count, payload slot) per sender, in
        sender order. Raises within about LIVENESS_S once a missing sender's process (sender_pids) has died:
        liveness is checked only after LIVENESS_S without any wake-up, never on the fast path."""
        if self._poll(rnd, what):
            self._sleep(rnd, timeout_s, what, sender_pids, sender_names)
        for s in range(self.num_senders):       # (cuda_ipc events: this stream waits for each sender's copies)
            self.buffers.await_signal(self.signals[_place(s, rnd, self.depth)])
        return [(self._flag(s, rnd, 1), self.slot(s, rnd)) for s in range(self.num_senders)]

    def _poll(self, rnd: int, what: str) -> list[int]:
        """Look for round rnd for up to SPIN_S, yielding the core between looks -> the senders still missing."""
        missing = self._missing(rnd, what)
        if missing:
            end = time.perf_counter() + SPIN_S
            while missing and time.perf_counter() < end:
                os.sched_yield()
                missing = self._missing(rnd, what)
        return missing

    def _sleep(self, rnd: int, timeout_s: float, what: str, sender_pids: list[int] | None,
               sender_names: list[str] | None) -> None:
        """Block on the FIFO until round rnd is complete, a sender is found dead, or timeout_s passes."""
        deadline = time.monotonic() + timeout_s
        silent = False
        while True:
            self.flags[SLEEP] = 1
            self.fence()            # the sleep word before the round words are read again (senders mirror it)
            missing = self._missing(rnd, what)
            if not missing:
                self.flags[SLEEP] = 0
                return
            names = sender_names or [f"sender {s}" for s in range(self.num_senders)]
            if silent and sender_pids is not None:
                dead = [names[s] for s in missing if not process_alive(sender_pids[s])]
                if dead:
                    raise PeerLost(f"{what}: {', '.join(dead)} died before sending round {rnd}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{what}: {', '.join(names[s] for s in missing)} sent nothing for round {rnd} "
                                   f"within {timeout_s}s")
            ready, _, _ = select.select([self.fifo], [], [], min(left, LIVENESS_S))
            self.flags[SLEEP] = 0
            silent = not ready
            if ready:
                with contextlib.suppress(BlockingIOError):  # another reader of ours cannot exist; be safe
                    os.read(self.fifo, 4096)


class Outlet:
    """A sender's handle on a peer's inbox: write a slot, make the write complete (buffers.publish), fence,
    publish the round, wake the peer. sender_index, depth and slot_bytes describe this sender's place in the
    peer's Inbox layout; export is the peer inbox's; name its files' stem (as the Inbox was given it)."""

    def __init__(self, directory: str, peer: int, fence: _StoreFence, sender_index: int, depth: int,
                 slot_bytes: int, buffers: HostShmBuffers | CudaIpcBuffers | None = None, export: object = None,
                 name: str | None = None):
        self.sender_index, self.depth, self.slot_bytes = sender_index, depth, slot_bytes
        self.buffers = buffers or HostShmBuffers()
        stem = os.path.join(directory, name or f"rank{peer}")
        self.flags = _map_words(f"{stem}.buf", 0, create=False)
        self.data, signals = self.buffers.open(f"{stem}.data", export)
        self.signals = [None] * depth if signals is None else signals[sender_index * depth:(sender_index + 1) * depth]
        self.fifo = os.open(f"{stem}.fifo", os.O_WRONLY | os.O_NONBLOCK)
        self.fence = fence

    def send(self, rnd: int, payload: torch.Tensor, count: int) -> None:
        """payload: `[bytes]` uint8 on the buffers' device (count rows already packed)."""
        self.write(rnd, payload)
        self.buffers.publish()
        self.post(rnd, count)

    def write(self, rnd: int, payload: torch.Tensor) -> None:
        """The payload into this sender's slot for round rnd, not yet visible: buffers.publish, then post."""
        if payload.numel() > self.slot_bytes:
            raise RuntimeError(f"message of {payload.numel()} bytes exceeds the {self.slot_bytes}-byte slot")
        self.slot(rnd)[:payload.numel()].copy_(payload)

    def slot(self, rnd: int) -> torch.Tensor:
        """This sender's slot for round rnd in the peer's inbox, `[slot_bytes]` uint8, for a sender that packs
        its message in place (then buffers.publish, then post)."""
        return _slot(self.data, self.sender_index, rnd, self.depth, self.slot_bytes)

    def post(self, rnd: int, count: int) -> None:
        """Signal the slot, publish round rnd's count and round word (the payload written and published) and wake
        the peer."""
        self.buffers.signal(self.signals[_place(0, rnd, self.depth)])
        flag = _flag(self.sender_index, rnd, self.depth)
        self.flags[flag + 1] = count
        self.fence()
        self.flags[flag] = rnd
        self.fence()                # the round word before the sleep word is read (the receiver mirrors it)
        if self.flags[SLEEP]:
            # A full FIFO holds earlier wake-ups already: the reader will see the round word anyway.
            with contextlib.suppress(BlockingIOError):
                os.write(self.fifo, b"\x01")

    def abort(self) -> None:
        """Mark the peer's inbox aborted and wake it (this rank is leaving the generation)."""
        self.flags[ABORT] = 1
        with contextlib.suppress(OSError):
            os.write(self.fifo, b"\x01")


def make_shared_dir(control, rank: int) -> str:
    """The leader creates a private directory (in /dev/shm when there is one) and broadcasts its path."""
    import tempfile

    import torch.distributed as dist

    buf = torch.zeros(512, dtype=torch.uint8)
    if rank == 0:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        path = tempfile.mkdtemp(prefix="afserve-", dir=base).encode()
        buf[:len(path)] = torch.tensor(list(path), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=control)
    return bytes(buf[buf != 0].tolist()).decode()
