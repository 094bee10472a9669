"""PD on AF: an attention rank's part in moving requests from prefill ranks to decode ranks.

With `prefill_ranks=P`, attention ranks 0..P-1 only prefill and the others only decode; both kinds join every
MoE layer's exchanges with the one expert pool. A prefill rank's scheduler keeps a request whose prefill is done
(its first token drawn) in place, holding its blocks (Scheduler.prefill_only), and its step report lists it
(`ready`). The leader picks a decode rank for it (attention_nodes/leader.py `plan_moves`) and names the move in
the next step's header: [prefill rank, decode rank, [request ids]]. At the start of that step, before the
forward, the two ranks carry it out: the prefill rank packs the request's samples and the KV blocks they hold
(attention_nodes/handover.py, as a leaving rank's handover does), drops them, and sends them through the
KVTransfer (comm/kv_transfer.py); the decode rank takes them over (its prefix cache learns the full blocks) and
decodes them in that same step. A request no decode rank has room for stays where it is and is offered again
after the next step.

Every rank goes through the header's moves in order, so the sends and receives pair up without a deadlock.
If a peer is lost during a step with moves, the leader re-forms with every attention rank saying which requests
it holds, and takes each request as being where a rank holds it (or queues it again when none does): the re-sent
step carries no moves (launch/runtime/step_protocol.py).
"""
from __future__ import annotations

from .handover import pack_sequences, unpack_sequences


def ready_requests(worker) -> list[list]:
    """A prefill rank's requests that wait to move, oldest first: [[request id, distinct KV blocks its samples
    hold, its samples], ...] (a request counts once all its live samples are prefilled)."""
    groups: dict[str, list] = {}
    for seq in worker.scheduler.parked():
        groups.setdefault(seq.group_id or seq.request_id, []).append(seq)
    live: dict[str, int] = {}
    for seq in worker.scheduler.running:
        rid = seq.group_id or seq.request_id
        live[rid] = live.get(rid, 0) + 1
    return [[rid, len({b for s in seqs for b in s.block_table}), len(seqs)]
            for rid, seqs in groups.items() if len(seqs) == live[rid]]


def apply_moves(worker, moves: list[list], transfer, sent_meta=None) -> None:
    """This rank's part of a step header's moves ([src, dst, [request ids]], in order): send the requests
    named (a prefill rank; one aborted in this step's header is gone and not sent) or take them over (a decode
    rank). Moved-in request ids and their blocks are counted on the worker (for the report and the pd stats).
    sent_meta(): called on a prefill rank between a move's description and its KV (fault injection)."""
    for src, dst, rids in moves:
        if worker.rank == src:
            wanted = set(rids)
            seqs = [s for s in worker.scheduler.running if (s.group_id or s.request_id) in wanted]
            meta, kv = pack_sequences(worker, seqs)
            for rid in rids:      # dropped before the send: if it fails, the leader finds who holds what
                worker.scheduler.abort(rid)
            transfer.send(meta, kv, dst, sent_meta)
        elif worker.rank == dst:
            meta, kv = transfer.recv(src)
            blocks = unpack_sequences(worker, meta, kv)
            taken = list(dict.fromkeys(d["group_id"] or d["request_id"] for d in meta["seqs"]))
            worker.moved_in_step += taken      # an aborted one was dropped by the prefill rank, not sent
            worker.pd_counts[0] += len(taken)
            worker.pd_counts[1] += blocks
