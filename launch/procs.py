"""Spawning local ranks from a plain Python process, keeping them from outliving it, and the leader's outbox to
the process that reads its progress."""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, replace

logger = logging.getLogger("afserve")
# what rank_context's fork server imports once: a rank then reads its checkpoint's config and builds its model
# without importing them (~2.5 s of CPU for torch, ~3 s more for transformers' config and modeling modules)
RANK_PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "launch.runtime"]
OUTBOX_PIPE_BYTES = 1 << 20    # what the outbox's pipe holds before the leader's put waits for its reader
_FRAME = struct.Struct("!Q")   # an outbox message's length, before its pickled bytes
_NOTHING = object()
_POLL_S = 0.05                 # how long a reader waits on the pipe before looking for messages put back


class Outbox:
    """The leader's progress (attention_nodes/leader.py's outbox messages) to one reader in another process (the
    LLM caller, or the HTTP front): a pipe that the leader writes in its own step loop. Unlike a
    multiprocessing Queue, nothing is handed to a feeder thread: that thread woke once per step to pickle the
    step's outputs and took the GIL from the step loop while the next step began (the step header's broadcast
    took ~0.2 ms longer on the 2-core dev VM at 64 sequences). Pickling here costs the leader ~0.05 ms a step.
    The pipe holds OUTBOX_PIPE_BYTES (where the system allows): a reader that falls that far behind holds the
    leader back rather than losing progress. Once the reader has closed its end (its process is gone), puts
    drop their messages: nobody is left to receive them. get() is queue.Queue's, for one or more threads of
    the reading process; it takes a message's bytes as they arrive, so a leader that dies in the middle of
    writing one leaves get() timing out (and its caller free to see the rank gone), never stuck in a read.
    put_back() returns messages taken out of turn (LLM.stats' wait) to the front."""

    def __init__(self, ctx) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)   # file descriptors that pickle to a spawned process
        with contextlib.suppress(OSError, AttributeError):
            with open("/proc/sys/fs/pipe-max-size") as f:
                size = min(OUTBOX_PIPE_BYTES, int(f.read()))
            fcntl.fcntl(self._writer.fileno(), fcntl.F_SETPIPE_SZ, size)
        self._init_local()

    def _init_local(self) -> None:
        self._lock = threading.Lock()
        self._gone = False
        self._partial = bytearray()      # the reader's bytes of messages not yet whole
        self._held: deque = deque()      # messages put back, served first

    def __getstate__(self):
        return self._reader, self._writer

    def __setstate__(self, state) -> None:
        self._reader, self._writer = state
        self._init_local()

    def put(self, msg) -> None:
        if self._gone:
            return
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(_FRAME.pack(len(data)) + data)
        try:
            while view:
                view = view[os.write(self._writer.fileno(), view):]
        except (BrokenPipeError, ConnectionResetError):
            self._gone = True
            logger.warning("the leader's progress reader has gone; its outbox messages are dropped from now on")

    def get(self, block: bool = True, timeout: float | None = None):
        deadline = None if timeout is None or not block else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._held:
                    return self._held.popleft()
                msg = self._take()
                if msg is not _NOTHING:
                    return msg
            left = None if deadline is None else deadline - time.monotonic()
            if not block or (left is not None and left <= 0):
                raise queue.Empty
            # waits outside the lock (a slice at a time, for put_back): another reader's timeout and put_back go on
            self._reader.poll(_POLL_S if left is None else min(left, _POLL_S))

    def get_nowait(self):
        return self.get(block=False)

    def put_back(self, msgs: list) -> None:
        """msgs (taken by get, in order) come out again before anything else."""
        with self._lock:
            self._held.extendleft(reversed(msgs))

    def _take(self):
        """With the lock held: the first whole message, reading what the pipe holds now (else _NOTHING). Only a
        reader holding the lock reads, and only what poll says is there: no read waits."""
        while True:
            msg = self._whole()
            if msg is not _NOTHING or not self._reader.poll(0):
                return msg
            chunk = os.read(self._reader.fileno(), 1 << 20)
            if not chunk:
                raise EOFError("every writer of the leader's outbox has closed it")
            self._partial += chunk

    def _whole(self):
        """The first message of what has arrived, if it is all there (else _NOTHING)."""
        if len(self._partial) < _FRAME.size:
            return _NOTHING
        end = _FRAME.size + _FRAME.unpack_from(self._partial)[0]
        if len(self._partial) < end:
            return _NOTHING
        data = bytes(self._partial[_FRAME.size:end])
        del self._partial[:end]      # first: a message that fails to unpickle is lost alone, as recv() lost it
        return pickle.loads(data)

    def close_reader(self) -> None:
        """The writing process, once the reader's process has its end: drop this one, so that a put finds
        out when the reader is gone instead of filling the pipe."""
        self._reader.close()


class LocalOutbox(queue.Queue):
    """The leader's outbox when it runs in the caller's own process (torchrun): a queue.Queue with Outbox's
    put_back."""

    def put_back(self, msgs: list) -> None:
        with self.mutex:
            self.queue.extendleft(reversed(msgs))
            self.not_empty.notify(len(msgs))


class Answers:
    """The leader's answers to stats(), comm_stats(), reset_prefix_cache() and scale() (("stats", ...) and so on on
    the outbox) that one thread of the reading process took while another waits for them: kept here for that one."""

    KINDS = ("stats", "comm_stats", "reset_prefix_cache", "scale")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._got: dict[str, deque] = {k: deque() for k in self.KINDS}

    def keep(self, msg: tuple) -> bool:
        """Keep msg if it is an answer (-> True)."""
        if msg[0] not in self._got:
            return False
        with self._lock:
            self._got[msg[0]].append(msg)
        return True

    def take(self, kind: str) -> tuple | None:
        """The oldest answer of kind kept, if any."""
        with self._lock:
            return self._got[kind].popleft() if self._got[kind] else None


def kill_all(procs: list) -> None:
    """SIGKILL the live processes of procs, then reap each (5 s at most)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so no rank is orphaned."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def leave_process(code: int = 0) -> None:
    """Exit at once, without the interpreter's teardown, for a rank that has left the job (retired by a scale
    request, or left out of the generation that went on). Its process groups were aborted and dropped, and
    tearing down what is left of them at interpreter exit was seen to abort the process once ("terminate
    called without an active exception", exit -6): under torchrun that makes the launch stop the rank's
    siblings, which are still serving."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_env(rank: int, world_size: int, port: int, join: bool, slot: int | None = None,
             local_world: int | None = None) -> dict[str, str]:
    """The environment torchrun would give a spawned rank (a fresh interpreter). A joiner's `rank` is its member
    id, which grows past the first launch's world size; its LOCAL_RANK is `slot` (free_slot: a place on the node
    no live rank holds; on CUDA it picks its GPU by it), and the node then counts at least slot + 1 local ranks
    beside the `local_world` ranks its first launch had there (default world_size: a launch of one host). That
    count decides a CUDA rank's backend (sizing.gpu_backend), so a joiner counts the node as its first ranks do."""
    local = rank if slot is None else slot
    first = world_size if local_world is None else local_world
    env = dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local),
               LOCAL_WORLD_SIZE=str(max(first, local + 1) if join else world_size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if join:
        env["AFSERVE_MEMBER"] = str(rank)
    return env


def free_slot(held: list[int]) -> int:
    """The lowest local rank that no live rank of this machine holds (held: theirs): a joiner takes the GPU of a
    rank that has left before a GPU no rank ever had, and member ids, which only grow, never decide it."""
    return min(set(range(len(held) + 1)) - set(held))


def visible_gpus(config) -> int:
    """The GPUs this process sees for a CUDA job (0 for any other)."""
    if config.device_type() != "cuda":
        return 0
    import torch
    return torch.cuda.device_count()


def joiner_slot(slots: list[int], procs: list, gpus: int, first_world: int, wait_s: float = 10.0,
                held: Sequence[int] = ()) -> int:
    """The local rank of a joiner spawned beside procs (slots: theirs): free_slot of the live ones and of `held`
    (slots taken whatever this process sees: a torchrun launch's own ranks). With a GPU per rank (CUDA, gpus >=
    the first launch's world: NCCL), a slot past the GPUs would share one over gloo, so it waits up to wait_s for
    a rank that retired to exit, then raises RuntimeError with the counts."""
    deadline = time.monotonic() + wait_s
    while True:
        slot = free_slot([*held, *(s for s, p in zip(slots, procs) if p.is_alive())])
        own_gpus = 0 < first_world <= gpus
        if not own_gpus or slot < gpus:
            return slot
        if time.monotonic() > deadline:
            raise RuntimeError(f"no free GPU for a joining rank: the {gpus} GPU(s) each hold a live rank of this job "
                               f"(one GPU per rank: NCCL) after {wait_s:.0f} s; retire ranks first, or launch more "
                               f"ranks than GPUs with transport='cuda_ipc' so that ranks share them")
        time.sleep(0.05)


def spawn_is_fresh(deadline: float | None, startup_timeout_s: float) -> bool:
    """Whether the ranks of a ("spawn", roles, deadline) message are still worth starting: its scale request
    fails at deadline, and a rank started with under half the start-up timeout left would come after that and
    join as a plain join, past the request (None: no deadline)."""
    return deadline is None or deadline - time.monotonic() > startup_timeout_s / 2


def rank_context():
    """The multiprocessing context ranks start in. On Linux a fork server that has imported torch, transformers
    and the runtime once (RANK_PRELOAD): each rank is a fork of it, where a fresh interpreter spent ~5 s of CPU
    importing them (on the 2-core VM the shipped model's 1+1 engine started in 7.2 s; from the fork server, once
    it runs, in 0.4 s; a rank joining a running job gains as much). The server never touches a GPU, so its
    forks may. Elsewhere, or with AFSERVE_START_METHOD=spawn (bench/startup.py compares the two), "spawn"."""
    method = os.environ.get("AFSERVE_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"AFSERVE_START_METHOD={method!r} is invalid: use forkserver (the default) or spawn")
    if method == "spawn" or not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def _release_fork_server() -> None:
    """In a fork of rank_context's server: close this process's copy of the server's "alive" pipe, which every
    fork inherits. The server exits when the pipe's last writer has closed it; with the ranks holding copies it
    would outlive the process that started them (killed, say), and the ranks, whose parent it is, with it: their
    die_with_parent signal fires only when it exits."""
    from multiprocessing import forkserver
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def start_rank(ctx, member: int, port: int, config, queues: tuple, join: bool = False,
               slot: int | None = None, local_world: int | None = None):
    """One rank's process (rank_main in ctx: rank_context's), started; queues: (inbox, outbox, status). A joiner
    (join) takes `member` as its member id, `slot` as its local rank and `local_world` as its node's first
    launch's local ranks (rank_env). The rank runs with this process's environment as it is now (a fork server's
    own is that of its start)."""
    name = f"afserve-member{member}" if join else f"afserve-rank{member}"
    p = ctx.Process(target=rank_main, name=name, daemon=True,
                    args=(member, config.parallel.world_size, port, config, *queues, join, slot, dict(os.environ),
                          local_world))
    p.start()
    return p


def start_joiner(ctx, member: int, role: str, port: int, pool_addr: str, config, queues: tuple, slots: list[int],
                 procs: list, first_world: int, held: Sequence[int] = ()):
    """A rank that joins the running job through its store at pool_addr in `role`, as member `member`, started
    beside procs (slots: theirs; both get the new one) in joiner_slot's slot; returns its process."""
    slot = joiner_slot(slots, procs, visible_gpus(config), first_world, held=held)
    proc = start_rank(ctx, member, port, replace(config, role=role, pool_addr=pool_addr), queues, True, slot,
                      first_world)
    slots.append(slot)
    procs.append(proc)
    return proc


def rank_main(rank: int, world_size: int, port: int, config, inbox, outbox, status, join: bool = False,
              slot: int | None = None, env: dict | None = None, local_world: int | None = None) -> None:
    """Entry point of one spawned rank. Reports ("ready", rank, info) or ("error", rank, text) on status.
    join: a rank that joins the running job (config has its role and the pool address), `rank` its member id,
    `slot` its local rank and `local_world` its node's first launch's local ranks (rank_env); env: its starter's
    environment, which replaces this process's."""
    die_with_parent()
    _release_fork_server()
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(rank_env(rank, world_size, port, join, slot, local_world))
    from .runtime import Runtime, follow, lead

    runtime = None
    try:
        runtime = Runtime(config)
        status.put(("ready", rank, asdict(runtime.info)))
        if runtime.leader is not None:
            lead(runtime, inbox, outbox, config.heartbeat_s)
        else:
            follow(runtime)
    except BaseException:
        text = f"rank {rank}: {traceback.format_exc()}"
        print(text, file=sys.stderr, flush=True)
        status.put(("error", rank, text))
        status.close()
        status.join_thread()  # flush the queue's feeder thread before the hard exit
        os._exit(1)
    runtime.close()
    if runtime.left:
        status.close()
        status.join_thread()
        leave_process(0)
