"""Run a function on W local ranks with gloo (DeepEP-style helper): a free port per call, explicit
teardown, a bounded wait, and results returned per rank."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback

from comm.shm import process_alive as alive  # noqa: F401  (the tests' name for it)
from launch.procs import free_port


def _child(fn, rank, world, port, args, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        # Plain pickle bytes: torch's queue pickler would share tensors by fd, which dies with the child.
        results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    """fn(rank, world, *args) on every rank -> [result of rank 0, ..., rank W-1]. Raises on any rank's error."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty as e:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(out))} did not finish in {timeout}s") from e
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
