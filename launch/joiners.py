"""Under torchrun (serve.py), the leader starts the ranks that its autoscaler's moves add: no front process
spawned the job, and torchrun cannot grow a running launch. Each joiner is a process beside the leader, on its
host, that joins the running job through its store (launch/runtime/membership.py, "Joining"), as the ranks that
LLM.scale spawns do."""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading

import torch.distributed as dist

from .procs import rank_context, spawn_is_fresh, start_joiner
from .runtime.liveness import draw_member_id

logger = logging.getLogger("afserve")


def _nothing() -> None:
    """A process that only starts (JoinerStarter._warm)."""


class JoinerStarter:
    """The leader's starter of joining ranks (Runtime.launcher; Membership.scale_as_leader calls start). A joiner
    takes a member id from the store's counter (past every id of the first launch, which the leader reserved) and
    the lowest local slot (its GPU on CUDA) that neither a rank of this host's launch (LOCAL_WORLD_SIZE) nor a
    live joiner holds; with a GPU per rank and none free, the start raises RuntimeError with the counts. A
    joiner that fails to start is logged; the scale request that wanted it then fails at its deadline."""

    def __init__(self, config, store: dist.Store, pool_addr: str, local_ranks: int):
        self.config, self.store, self.local_ranks = config, store, local_ranks
        self.port = int(pool_addr.rpartition(":")[2])
        self.pool_addr = pool_addr
        self.ctx = rank_context()
        self.status = self.ctx.Queue()
        self.procs: list = []
        self.slots: list[int] = []
        self.members: list[int] = []
        threading.Thread(target=self._watch, name="afserve-joiners", daemon=True).start()
        # the fork server imports torch and transformers once (seconds): now, on a thread of its own, rather
        # than in the leader's step loop when the first move comes
        threading.Thread(target=self._warm, name="afserve-fork-server", daemon=True).start()

    @classmethod
    def beside_leader(cls, config, store: dist.Store) -> JoinerStarter:
        """The leader's, under torchrun: the job's store is at the pool address (separate pool launches) or
        torchrun's MASTER_ADDR:MASTER_PORT; this host's launch has LOCAL_WORLD_SIZE ranks."""
        addr = config.pool_addr or f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"
        return cls(config, store, addr, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def start(self, roles: list[str], deadline: float | None) -> None:
        """Start one joiner per role ("attention", "expert", ...), unless its request's deadline is too near
        (spawn_is_fresh)."""
        if not spawn_is_fresh(deadline, self.config.startup_timeout_s):
            logger.warning("joiners %s not started: their scale request times out before they could join", roles)
            return
        started = len(self.procs)
        try:
            for role in roles:
                member = draw_member_id(self.store)
                proc = start_joiner(self.ctx, member, role, self.port, self.pool_addr, self.config,
                                    (None, None, self.status), self.slots, self.procs, self.local_ranks,
                                    held=range(self.local_ranks))     # this host's torchrun ranks
                self.members.append(member)
                logger.info("started joiner member %d (%s) in local slot %d, pid %d", member, role, self.slots[-1],
                            proc.pid)
        except Exception:   # none of this request's joiners stays: one alone would join past its failed request
            for proc in self.procs[started:]:
                proc.kill()
            raise

    def _warm(self) -> None:
        with contextlib.suppress(Exception):
            p = self.ctx.Process(target=_nothing, daemon=True)
            p.start()
            p.join()

    def _watch(self) -> None:
        while True:
            try:
                msg = self.status.get()
            except (EOFError, OSError, queue.Empty):
                return
            if msg[0] == "error":
                logger.error("a joining rank failed to start: %s", msg[2])
