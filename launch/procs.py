"""Spawning local ranks from a plain Python process, and keeping them from outliving it."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import traceback
from dataclasses import asdict


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


def rank_env(rank: int, world_size: int, port: int, join: bool) -> dict[str, str]:
    """The environment torchrun would give a spawned rank (a fresh interpreter). A joiner's `rank` is its member
    id, which grows past the first launch's world size: the node then counts at least rank + 1 local ranks, so
    its LOCAL_RANK stays inside LOCAL_WORLD_SIZE (on CUDA it picks its GPU from them)."""
    env = dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(max(world_size, rank + 1) if join else world_size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if join:
        env["AFSERVE_MEMBER"] = str(rank)
    return env


def rank_main(rank: int, world_size: int, port: int, config, inbox, outbox, status, join: bool = False) -> None:
    """Entry point of one spawned rank. Reports ("ready", rank, info) or ("error", rank, text) on status.
    join: a rank that joins the running job (config has its role and the pool address), `rank` its member id."""
    die_with_parent()
    os.environ.update(rank_env(rank, world_size, port, join))
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
