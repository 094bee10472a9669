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

With prefix caching the KV is streamed ahead of the move (`stream_kv`): a prefill rank's report also lists its
requests mid-prefill with their full blocks computed (`prefilling`), the leader's KVStream names in the next
header the blocks each completed since its last push, to one decode rank per request (`pushes`, carried out after
the moves), and that rank keeps those its prefix cache lacks as cached, unheld blocks; the move, which prefers the
decode rank caching the longest prefix, then asks only for the rest.

Every rank goes through the header's moves and pushes in order, so the sends and receives pair up without a
deadlock.
If a peer is lost during a step with moves, the leader re-forms with every attention rank saying which requests
it holds, and takes each request as being where a rank holds it (or queues it again when none does): the re-sent
step carries no moves and no pushes (launch/runtime/step_protocol.py; the next pushes start over).
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch

from .block_pool import chain_hashes
from .handover import pack_sequences, receive_sequences, write_new_blocks

# Upper bounds (seconds) of the KV transfer latency histogram's buckets, as afserve's latency histograms have them.
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class TransferStats:
    """A decode rank's moves taken over, cumulative: requests, KV blocks received, KV bytes, seconds (from the
    start of the receive to the blocks in place), KV blocks reused from its prefix cache instead, and the seconds
    per move as histogram bucket counts (TRANSFER_BUCKETS, then one for longer); and the KV streamed to it ahead of
    the moves (pushes): blocks, bytes, seconds. to_list() is what the step report carries."""

    def __init__(self) -> None:
        self.requests = self.blocks = self.bytes = self.reused = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(TRANSFER_BUCKETS) + 1)
        self.streamed = self.streamed_bytes = 0
        self.streamed_seconds = 0.0

    def add(self, requests: int, blocks: int, nbytes: int, seconds: float, reused: int = 0) -> None:
        self.requests += requests
        self.blocks += blocks
        self.bytes += nbytes
        self.seconds += seconds
        self.reused += reused
        self.buckets[bisect.bisect_left(TRANSFER_BUCKETS, seconds)] += 1

    def add_streamed(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.streamed += blocks
        self.streamed_bytes += nbytes
        self.streamed_seconds += seconds

    def to_list(self) -> list:
        return [self.requests, self.blocks, self.bytes, self.seconds, self.reused, *self.buckets, self.streamed,
                self.streamed_bytes, self.streamed_seconds]


def summed(reports: list[list]) -> dict:
    """The attention ranks' TransferStats lists -> the leader's totals (requests_transferred, kv_blocks_transferred,
    kv_bytes_transferred, kv_transfer_seconds, kv_blocks_reused, kv_transfer_buckets: counts per bucket of
    TRANSFER_BUCKETS + 1; kv_blocks_streamed, kv_bytes_streamed, kv_stream_seconds)."""
    nb = len(TRANSFER_BUCKETS) + 1
    total = [sum(r[i] for r in reports if r) for i in range(5 + nb + 3)]
    return {"requests_transferred": total[0], "kv_blocks_transferred": total[1], "kv_bytes_transferred": total[2],
            "kv_transfer_seconds": total[3], "kv_blocks_reused": total[4], "kv_transfer_buckets": total[5:5 + nb],
            "kv_blocks_streamed": total[5 + nb], "kv_bytes_streamed": total[6 + nb],
            "kv_stream_seconds": total[7 + nb]}


def ready_requests(worker) -> list[list]:
    """A prefill rank's requests that wait to move, in admission order: [[request id, distinct KV blocks its samples
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


# ----- the leader's plans ---------------------------------------------------------------------------------------
def choose_decode_rank(candidates, hit: list[int], free: dict[int, int]) -> int:
    """The decode rank a request's KV goes to, among candidates: the one caching the longest prefix of its prompt
    (hit: leading full blocks cached, by rank), then with the most free blocks, then the lowest rank. Moves and
    pushes choose alike, so that a request's move goes where its pushes went."""
    return max(candidates, key=lambda d: (hit[d], free[d], -d))


def plan_moves(reports, prefill_ranks: int, max_seqs: int, owner: dict[str, int],
               hits: Callable[[str], list[int]] | None, aborted: frozenset[str]) -> tuple[list[list], int]:
    """The moves of the next step, [prefill rank, decode rank, [request ids]], for the requests the prefill ranks
    reported done with their prefill (reports: the last step's, by attention rank), oldest first per rank, and how
    many of them wait for a decode seat. A request goes to the decode rank with a seat and its blocks free that
    caches the longest prefix of its prompt (hits(request id): per rank, leading full blocks cached; None: no
    prefix caching), then has the most free blocks; none has room: it waits at its prefill rank and is offered
    again next step. A request is moved only while owner (request id -> its rank, updated for the moves) has it
    on that prefill rank and no abort for it is in the step; a decode rank needs its blocks plus one per sample
    free (the next token's)."""
    P, A = prefill_ranks, len(reports)
    free = {d: reports[d].num_free_blocks for d in range(P, A)}
    seats = {d: max_seqs - reports[d].num_running - reports[d].num_waiting for d in range(P, A)}
    moves: dict[tuple[int, int], list[str]] = {}
    waiting = 0
    for src in range(P):
        for rid, blocks, samples in reports[src].ready:
            if owner.get(rid) != src or rid in aborted:
                continue
            room = [d for d in free if free[d] >= blocks + samples and seats[d] >= samples]
            if not room:
                waiting += 1
                continue
            hit = hits(rid) if hits is not None else [0] * A
            dst = choose_decode_rank(room, hit, free)
            free[dst] -= blocks
            seats[dst] -= samples
            owner[rid] = dst
            moves.setdefault((src, dst), []).append(rid)
    return [[src, dst, rids] for (src, dst), rids in moves.items()], waiting


class KVStream:
    """The leader's record of the streamed transfer: for each request mid-prefill on a prefill rank, the decode
    rank its prompt's KV goes to and how many of its full blocks have gone. The rank is chosen at the request's
    first push, as a move chooses (the longest cached prefix, then the most free blocks, a request placed in the
    step counting its prompt's blocks against its rank) but with no room check: the move checks. plan() turns the
    prefill ranks' reports (`prefilling`: [request id, full blocks computed]) into the next step's pushes."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[int, int]] = {}      # request id -> (decode rank, full blocks pushed)

    def plan(self, reports, prefill_ranks: int, owner: dict[str, int], hits: Callable[[str], list[int]],
             prompt_blocks: Callable[[str], int], aborted: frozenset[str]) -> list[list]:
        """-> [[prefill rank, decode rank, [[request id, first block, end block], ...]], ...]: the blocks each
        request completed since its last push. A request no longer mid-prefill is forgotten (its move, or its
        end, follows)."""
        P, A = prefill_ranks, len(reports)
        sent, pushes = {}, {}
        free = {d: reports[d].num_free_blocks for d in range(P, A)}
        for src in range(P if P < A else 0):      # no decode rank: nowhere to push
            for rid, full in reports[src].prefilling:
                if owner.get(rid) != src or rid in aborted:
                    continue
                if rid in self.sent:
                    dst, done = self.sent[rid]
                else:
                    hit = hits(rid)
                    dst, done = choose_decode_rank(free, hit, free), 0
                    free[dst] -= prompt_blocks(rid)
                sent[rid] = (dst, max(done, full))
                if full > done:
                    pushes.setdefault((src, dst), []).append([rid, done, full])
        self.sent = sent
        return [[src, dst, items] for (src, dst), items in pushes.items()]


# ----- the ranks' part ------------------------------------------------------------------------------------------
def prefilling_requests(worker) -> list[list]:
    """A prefill rank's requests mid-prefill: [[request id, full blocks of its prompt computed so far], ...]
    (those with at least one, and that will move: not max_tokens=0)."""
    bs, out = worker.block_pool.block_size, {}
    for seq in worker.scheduler.running:
        full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // bs
        if seq.num_computed_tokens < seq.num_prompt_tokens and full and seq.params.max_tokens != 0:
            out[seq.group_id or seq.request_id] = full
    return [[rid, full] for rid, full in out.items()]


def pack_blocks(worker, items: list[list]) -> tuple[dict, torch.Tensor]:
    """A prefill rank's part of a push, items [[request id, first block, end block], ...] -> (meta {"spans":
    [[the prefix-cache keys of the request's blocks 0..end-1, first], ...], "num_blocks", "shape"}, the KV of
    each span's blocks first..end-1 `[layers, c, n, block_size, heads, dim]`). The keys come from the sequence's
    own memo (no token is sent or hashed again). A request no longer here, or not computed that far, sends
    nothing."""
    bs = worker.block_pool.block_size
    held = {s.group_id or s.request_id: s for s in worker.scheduler.running}
    spans, ids = [], []
    for rid, first, end in items:
        seq = held.get(rid)
        if seq is None or seq.num_computed_tokens < end * bs or len(seq.block_table) < end:
            continue
        spans.append([chain_hashes(seq.token_ids, bs, seq.block_keys, limit=end, salt=seq.params.cache_salt)[:end],
                      first])
        ids += seq.block_table[first:end]
    kv = worker.kv.tensor[:, :, torch.tensor(ids, dtype=torch.int64, device=worker.kv.tensor.device)].contiguous()
    return {"spans": spans, "num_blocks": len(ids), "shape": list(kv.shape)}, kv


def receive_blocks(worker, transfer, src: int) -> tuple[int, int]:
    """A decode rank's part of a push from src: ask for the blocks its prefix cache lacks (none when its free
    blocks cannot take them all), write them into fresh blocks and register them in the prefix cache, unheld
    (evictable like any cached block; the request's move finds them there) -> (blocks received, KV bytes). The
    request's blocks cached here already (earlier pushes) are held while the new ones are allocated, so that
    these do not evict them (they were freed longest ago)."""
    pool, keys, kept = worker.block_pool, {}, []      # keys: key -> packed index, in the order asked for

    def wanted(meta: dict) -> list[int]:
        i = 0
        for chain, first in meta["spans"]:
            kept.extend(pool.lookup(chain[:first]))
            for key in chain[first:]:
                if not pool.holds(key):
                    keys.setdefault(key, i)
                i += 1
        need = list(keys.values())
        return need if len(need) <= pool.num_free_blocks - pool.num_revived(set(kept)) else []
    _, kv = transfer.recv(src, wanted)
    n = 0 if kv is None else kv.shape[2]
    if not n:
        return 0, 0
    kept[:] = list(dict.fromkeys(kept))       # a block two spans share is held once
    pool.take(kept)
    new = write_new_blocks(worker, kv)
    for block, key in zip(new, keys):
        pool.register(block, key)
    pool.free(reversed(kept + new))
    return n, kv.numel() * kv.element_size()


def apply_pushes(worker, pushes: list[list], transfer) -> None:
    """This rank's part of a step header's pushes ([src, dst, [[request id, first block, end block], ...]], in
    order, after the step's moves): a prefill rank sends the blocks its requests completed since their last push,
    a decode rank keeps those its prefix cache lacks (pd_stats counts them)."""
    for src, dst, items in pushes:
        if worker.rank == src:
            transfer.send(*pack_blocks(worker, items), dst)
        elif worker.rank == dst:
            t0 = time.perf_counter()
            blocks, nbytes = receive_blocks(worker, transfer, src)
            worker.pd_stats.add_streamed(blocks, nbytes, time.perf_counter() - t0)
