"""PD on AF: an attention rank's part in moving requests from prefill ranks to decode ranks.

With `prefill_ranks=P`, attention ranks 0..P-1 only prefill and the others only decode; both kinds join every
MoE layer's exchanges with the one expert pool. A prefill rank's scheduler keeps a request whose prefill is done
(its first token drawn) in place, holding its blocks (Scheduler.prefill_only), and its step report lists it
(`ready`). The leader picks a decode rank for it (attention_nodes/leader.py `plan_moves`) and names the move in
the next step's header: [prefill rank, decode rank, [request ids]]. At the start of that step, before the
forward, the two ranks carry it out: the prefill rank packs the request's samples and the KV blocks they hold
(attention_nodes/handover.py, as a leaving rank's handover does), drops them, and sends them through the
KVTransfer (comm/kv_transfer.py); the decode rank asks only for the blocks its own prefix cache does not hold
(the leader prefers the decode rank caching the longest prefix), takes the requests over (its prefix cache
learns the full blocks) and decodes them in that same step. A request no decode rank has room for stays where it
is and is offered again after the next step.

Every rank goes through the header's moves in order, so the sends and receives pair up without a deadlock.
If a peer is lost during a step with moves, the leader re-forms with every attention rank saying which requests
it holds, and takes each request as being where a rank holds it (or queues it again when none does): the re-sent
step carries no moves (launch/runtime/step_protocol.py).
"""
from __future__ import annotations

import bisect
import time

from .handover import pack_sequences, receive_sequences

# Upper bounds (seconds) of the KV transfer latency histogram's buckets, as afserve's latency histograms have them.
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class TransferStats:
    """A decode rank's moves taken over, cumulative: requests, KV blocks received, KV bytes, seconds (from the
    start of the receive to the blocks in place), KV blocks reused from its prefix cache instead, and the seconds
    per move as histogram bucket counts (TRANSFER_BUCKETS, then one for longer). to_list() is what the step
    report carries."""

    def __init__(self) -> None:
        self.requests = self.blocks = self.bytes = self.reused = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(TRANSFER_BUCKETS) + 1)

    def add(self, requests: int, blocks: int, nbytes: int, seconds: float, reused: int = 0) -> None:
        self.requests += requests
        self.blocks += blocks
        self.bytes += nbytes
        self.seconds += seconds
        self.reused += reused
        self.buckets[bisect.bisect_left(TRANSFER_BUCKETS, seconds)] += 1

    def to_list(self) -> list:
        return [self.requests, self.blocks, self.bytes, self.seconds, self.reused, *self.buckets]


def summed(reports: list[list]) -> dict:
    """The attention ranks' TransferStats lists -> the leader's totals (requests_transferred, kv_blocks_transferred,
    kv_bytes_transferred, kv_transfer_seconds, kv_blocks_reused, kv_transfer_buckets: counts per bucket of
    TRANSFER_BUCKETS + 1)."""
    width = 5 + len(TRANSFER_BUCKETS) + 1
    total = [sum(r[i] for r in reports if r) for i in range(width)]
    return {"requests_transferred": total[0], "kv_blocks_transferred": total[1], "kv_bytes_transferred": total[2],
            "kv_transfer_seconds": total[3], "kv_blocks_reused": total[4], "kv_transfer_buckets": total[5:]}


def ready_requests(worker) -> list[list]:
    """A prefill rank's requests that wait to move, oldest first: [[request id, distinct KV blocks its samples
    hold, its samples], ...] (a request counts once all its live samples are prefilled)."""
    groups: dict[str, list] = {}
    for seq in worker.scheduler.parked():
        groups.setdefault(seq.group_id or seq.request_id, []).append(seq)
    live: dict[str, int] = {}      # a sample still waiting (preempted, or resumed without a seat) holds it back
    for seq in list(worker.scheduler.running) + list(worker.scheduler.waiting):
        rid = seq.group_id or seq.request_id
        live[rid] = live.get(rid, 0) + 1
    return [[rid, len({b for s in seqs for b in s.block_table}), len(seqs)]
            for rid, seqs in groups.items() if len(seqs) == live[rid]]


def apply_moves(worker, moves: list[list], transfer, sent_meta=None) -> None:
    """This rank's part of a step header's moves ([src, dst, [request ids]], in order): send the requests
    named (a prefill rank; one aborted in this step's header is gone and not sent) or take them over (a decode
    rank). A decode rank without the seats or blocks for them (its report was older than what it admitted since)
    refuses the move: the prefill rank keeps them, still ready, and the leader offers them again. A decode rank
    counts the moves it takes over in its pd_stats.
    sent_meta(): called on a prefill rank between a move's description and its KV (fault injection)."""
    for src, dst, rids in moves:
        if worker.rank == src:
            wanted = set(rids)
            seqs = [s for s in worker.scheduler.running if (s.group_id or s.request_id) in wanted]
            meta, kv = pack_sequences(worker, seqs)

            def drop(seqs=seqs):      # accepted: dropped before the KV goes (if it fails, the leader finds who
                for seq in seqs:      # holds what)
                    worker.scheduler.abort(seq.request_id)
            transfer.send(meta, kv, dst, sent_meta, drop)
        elif worker.rank == dst:
            t0 = time.perf_counter()
            meta, take, nbytes = receive_sequences(worker, transfer, src, refuse=True)
            if take is None:
                continue
            # requests, not samples (an aborted one was dropped by the prefill rank, not sent)
            taken = {d["group_id"] or d["request_id"] for d in meta["seqs"]}
            worker.pd_stats.add(len(taken), len(take.need), nbytes, time.perf_counter() - t0, len(take.have))
