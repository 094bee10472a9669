"""The frontend leader on attention rank 0.

It takes commands from the front (LLM or HTTP server) through an inbox queue, gives each new
request to the attention rank that caches the longest prefix of it when that rank has room, else to the one
with the most free KV blocks (cache-aware routing: each rank's report carries the keys of the blocks its
prefix cache gained and lost since the last step, so the leader mirrors every rank's cache as a set of
64-bit keys and hashes each new prompt once), broadcasts the step header, and
pushes per-request progress to an outbox queue. Inbox commands: ("add", request dict),
("abort", request_id), ("stats",), ("comm_stats"[, events]), ("shutdown",). Outbox messages, one per step at
most: ("out", [[request_id, [new token ids], finish_reason or None, new
prompt logprobs or None, new token logprobs or None], ...]), ("stats", dict) and
("comm_stats", dict). Every `rebalance_interval` steps (when > 0) the leader calls a re-placement, which
every rank joins between steps.
"""
from __future__ import annotations

import queue
from collections import deque

from comm.control import (
    COLLECT_EVENTS,
    COLLECT_STATS,
    IDLE,
    PAUSE,
    REBALANCE,
    SHUTDOWN,
    STEP,
    ControlPlane,
    StepHeader,
    StepReport,
)

from .block_pool import chain_hashes
from .sequence import request_of, sample_ids
from .worker import AttentionWorker


class Leader:
    def __init__(self, control: ControlPlane, worker: AttentionWorker, num_attention_ranks: int, block_size: int,
                 hooks: dict | None = None, rebalance_interval: int = 0, cache_aware: bool = False):
        """hooks: header kind -> what every rank runs for it (REBALANCE, COLLECT_STATS, COLLECT_EVENTS), given by
        the runtime."""
        self.control, self.worker = control, worker
        self.hooks = hooks or {}
        self.rebalance_interval = rebalance_interval
        self.num_attention_ranks = num_attention_ranks
        self.block_size = block_size
        self.token_budget = worker.scheduler.max_num_batched_tokens
        self.step_id = 0
        self.pending: deque[dict] = deque()
        self.req2rank: dict[str, int] = {}
        self.open_samples: dict[str, int] = {}   # request id -> its samples not finished yet
        self.cache_aware = cache_aware
        self.cached: list[set[int]] = [set() for _ in range(num_attention_ranks)]   # each rank's cached keys
        self.num_routed_to_cache = 0     # requests sent to a rank that caches a prefix of their prompt
        self.reports = [worker.report() for _ in range(num_attention_ranks)]
        for r, rep in enumerate(self.reports):
            rep.rank = r

    @property
    def has_work(self) -> bool:
        return bool(self.pending) or any(r.num_running or r.num_waiting for r in self.reports)

    def _assign(self) -> dict[str, list[dict]]:
        """The rank caching the longest prefix if it has room for the prompt, else the most free KV blocks; the
        free-block estimate is charged for what is assigned this step."""
        free = [r.num_free_blocks for r in self.reports]
        out: dict[str, list[dict]] = {}
        while self.pending:
            req = self.pending.popleft()
            need = -(-len(req["prompt"]) // self.block_size)
            rank = max(range(self.num_attention_ranks), key=lambda r: (free[r], -r))
            if self.cache_aware and self.num_attention_ranks > 1:
                hit = self._cached_prefix(req["prompt"])
                best = max(range(self.num_attention_ranks), key=lambda r: (hit[r], free[r], -r))
                if hit[best] > hit[rank] and free[best] >= need:
                    rank = best
                self.num_routed_to_cache += hit[rank] > 0
            free[rank] -= need
            self.req2rank[req["id"]] = rank
            self.open_samples[req["id"]] = _num_samples(req)
            out.setdefault(str(rank), []).append(req)
        return out

    def _cached_prefix(self, prompt: list[int]) -> list[int]:
        """Per rank, how many leading full blocks of prompt its prefix cache holds (the last token never counts:
        it is always computed)."""
        keys = chain_hashes(prompt, self.block_size, limit=(len(prompt) - 1) // self.block_size)
        hits = []
        for cached in self.cached:
            n = 0
            while n < len(keys) and keys[n] in cached:
                n += 1
            hits.append(n)
        return hits

    def _handle(self, cmd: tuple, aborts: dict[str, list[str]], outbox) -> bool:
        """Apply one inbox command; returns False on shutdown."""
        kind = cmd[0]
        if kind == "add":
            self.pending.append(cmd[1])
        elif kind == "abort":     # a request's id, or one sample's (f"{request id}#{index}")
            rid = cmd[1]
            base = request_of(rid)
            dropped = [r for r in self.pending if r["id"] in (rid, base)]
            if dropped:           # not assigned yet: every sample of it ends here
                self.pending = deque(r for r in self.pending if r not in dropped)
                ids = sample_ids(dropped[0]["id"], _num_samples(dropped[0]))
                outbox.put(("out", [[i, [], "abort", None, None] for i in ids]))
            elif base in self.req2rank:
                aborts.setdefault(str(self.req2rank[base]), []).append(rid)
        elif kind == "stats":
            outbox.put(("stats", self.stats()))
        elif kind == "comm_stats":      # ("comm_stats", events: bool = False)
            outbox.put(("comm_stats", self._collective(COLLECT_EVENTS if len(cmd) > 1 and cmd[1] else COLLECT_STATS)))
        elif kind == "shutdown":
            return False
        else:
            raise ValueError(f"unknown inbox command {kind!r}")
        return True

    def serve(self, inbox, outbox, heartbeat_s: float, stop_when_idle: bool = False) -> str:
        """Run steps until shutdown (returns "shutdown") or, with stop_when_idle, until all work is done
        (broadcasts a pause and returns "pause"). Idle: blocks on the inbox, heartbeating every heartbeat_s."""
        while True:
            aborts: dict[str, list[str]] = {}
            alive = True
            try:
                # Block (heartbeating) only when idle and serving; a generate() call ends as soon as it is done.
                idle_wait = not self.has_work and not stop_when_idle
                cmd = inbox.get(timeout=heartbeat_s) if idle_wait else inbox.get_nowait()
                alive = self._handle(cmd, aborts, outbox)
                while alive:
                    alive = self._handle(inbox.get_nowait(), aborts, outbox)
            except queue.Empty:
                pass
            if not alive:
                self.control.broadcast_header(StepHeader.empty(SHUTDOWN, self.step_id))
                return SHUTDOWN
            if not self.has_work and not aborts:
                kind = PAUSE if stop_when_idle else IDLE
                self.control.broadcast_header(StepHeader.empty(kind, self.step_id))
                if stop_when_idle:
                    return PAUSE
                continue
            self.step_id += 1
            new = self._assign()
            # Ranks that get new requests may admit up to a full token budget this step.
            capacity = max([r.max_next_tokens for r in self.reports] + [self.token_budget] * bool(new))
            header = StepHeader(STEP, self.step_id, capacity, new, aborts)
            self.control.broadcast_header(header)
            reports = self.control.gather_reports(run_attention_step(self.worker, header))
            self._collect(reports, outbox)
            if self.rebalance_interval and self.step_id % self.rebalance_interval == 0:
                self._collective(REBALANCE)

    def _collective(self, kind: str):
        """Between steps: tell every rank to join the hook for kind, and run it here too."""
        if kind not in self.hooks:
            raise ValueError(f"this engine has no {kind!r} hook")
        self.control.broadcast_header(StepHeader.empty(kind, self.step_id))
        return self.hooks[kind]()

    def stats(self) -> dict:
        """Engine counters summed over attention ranks, as of the last step, per-rank free and total KV
        blocks, and the KV-cache bytes one token takes per layer (every attention rank holds the same layout)."""
        return {"steps": self.step_id,
                "num_preemptions": sum(r.num_preemptions for r in self.reports),
                "num_prefill_chunks": sum(r.num_prefill_chunks for r in self.reports),
                "num_running": sum(r.num_running for r in self.reports),
                "num_waiting": sum(r.num_waiting for r in self.reports) + len(self.pending),
                "free_kv_blocks": [r.num_free_blocks for r in self.reports],
                "kv_blocks": [r.num_blocks for r in self.reports],
                "prefix_cache_queries": sum(r.prefix_queries for r in self.reports),
                "prefix_cache_hits": sum(r.prefix_hits for r in self.reports),
                "prompt_tokens_computed": sum(r.prompt_tokens_computed for r in self.reports),
                "kv_offload_saved_blocks": sum(r.offload_saved for r in self.reports),
                "kv_offload_restored_blocks": sum(r.offload_restored for r in self.reports),
                "num_routed_to_cache": self.num_routed_to_cache,
                "kv_bytes_per_token_per_layer": self.worker.kv.bytes_per_token}

    def _collect(self, reports: list[StepReport], outbox) -> None:
        self.reports = reports
        for rep in reports:
            cached = self.cached[rep.rank]   # within a step, blocks are evicted (schedule) before any is added
            cached.difference_update(rep.cache_evicted)
            cached.update(rep.cache_added)
        outputs = [out for rep in reports for out in rep.outputs]
        for rid, _, finish, *_ in outputs:
            if finish is None:
                continue
            base = request_of(rid)
            left = self.open_samples.get(base, 1) - 1
            if left > 0:
                self.open_samples[base] = left
            else:
                self.open_samples.pop(base, None)
                self.req2rank.pop(base, None)
        if outputs:
            outbox.put(("out", outputs))


def _num_samples(req: dict) -> int:
    p = req["params"]
    return p.get("best_of") or p.get("n", 1)


def run_attention_step(worker: AttentionWorker, header: StepHeader) -> StepReport:
    """What every attention rank does with a "step" header."""
    worker.add_requests(header.requests_for(worker.rank))
    worker.abort(header.aborts_for(worker.rank))
    return worker.step(header.capacity)
