"""The frontend leader on attention rank 0.

It takes commands from the front (LLM or HTTP server) through an inbox queue, gives each new request to the
attention rank that caches the longest prefix of it when that rank has room, else to the one with the most free KV
blocks (cache-aware routing: each rank's report carries the keys of the blocks its prefix cache gained and lost
since the last step, so the leader mirrors every rank's cache as a set of 64-bit keys and hashes each new prompt
once), broadcasts the step header, and pushes per-request progress to an outbox queue. Inbox commands: ("add",
request dict, ...), ("abort", request_id), ("stats",), ("comm_stats"[, events]), ("reset_prefix_cache",), ("scale",
{"attention_ranks", "expert_ranks", "retire"}), ("shutdown",).
Outbox messages, one per step at most: ("out", [[request_id, [new token ids], finish_reason or None, new prompt
logprobs ((entry, rank) pairs) or None, new token logprobs or None, cached prompt tokens or None], ...]), ("stats",
dict), ("comm_stats", dict) and ("reset_prefix_cache", True); between steps, a scale request's ("spawn", [roles],
deadline) and ("scale", record), and the autoscaler's ("autoscaled", record). A request added with "stream": False
(`LLM.generate`, which returns only whole outputs) has its progress held back for up to HOLD_STEPS steps, or until
a step in which some request finishes, a streamed request makes progress or the leader runs out of work; the held
outputs then go out, in order, in one message (one pickle and one pipe write for several steps instead of one per
step, and the reading process wakes as rarely; the bound keeps what the reader has left to take in when the last
request ends small).
PD (`prefill_ranks` P > 0): new requests go to attention ranks 0..P-1 only; a request whose prefill is done there
moves to the decode rank (P..) with room for it, the longest cached prefix of its prompt first, then the most free
blocks (`plan_moves`; attention_nodes/pd.py carries the moves out).
Every `rebalance_interval` steps (when > 0) the leader calls a re-placement, which every rank joins between
steps. The loop that drives all this, and the header kinds, are in launch/runtime/step_protocol.py; this class
is the leader's request state.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace

from comm.control import StepHeader, StepReport

from .block_pool import chain_hashes
from .passes import PassPlanner, step_shape
from .pd import KVStream, plan_moves
from .pd import summed as pd_summed
from .sequence import request_of, sample_ids, split_sample_id
from .speculation import summed as spec_summed
from .worker import AttentionWorker

HOLD_STEPS = 8     # at most this many steps' outputs of requests added with "stream": False are held back
# stats(): engine counters summed over the attention ranks' reports (name -> StepReport field)
SUMMED = {"num_preemptions": "num_preemptions", "num_prefill_chunks": "num_prefill_chunks",
          "num_running": "num_running", "prefix_cache_queries": "prefix_queries", "prefix_cache_hits": "prefix_hits",
          "prompt_tokens_computed": "prompt_tokens_computed", "kv_offload_saved_blocks": "offload_saved",
          "kv_offload_restored_blocks": "offload_restored", "kv_blocks_handed_over": "kv_blocks_received"}


class Leader:
    def __init__(self, worker: AttentionWorker, num_attention_ranks: int, block_size: int,
                 rebalance_interval: int = 0, cache_aware: bool = False, micro_batches: int = 1,
                 micro_batch_min_tokens: int = 0, draft_passes: int = 0, disable_by_batch_size: int | None = None,
                 prefill_ranks: int = 0, max_decode_passes: int = 1, stream_kv: bool = False):
        """draft_passes: the MTP passes of a step (speculative method "mtp"), none while every rank runs
        disable_by_batch_size sequences or more. prefill_ranks: PD's prefill ranks (0: none), whose decode ranks
        run up to max_decode_passes forwards a step (attention_nodes/passes.py); stream_kv: with prefix caching,
        a request's full prompt blocks go to its decode rank as its prefill chunks complete (pd.KVStream)."""
        self.worker = worker
        self.prefill_ranks = prefill_ranks
        self.kv_stream = KVStream() if stream_kv else None
        self.pass_planner = PassPlanner(max_decode_passes)
        self.num_waiting_for_decode = 0  # PD: prefilled requests no decode rank had room for, at the last step
        self.unheld: set[str] = set()    # PD: requests of a failed step's moves that no rank said it holds
        self.draft_passes, self.disable_by_batch_size = draft_passes, disable_by_batch_size
        self.micro_batches, self.micro_batch_min_tokens = micro_batches, micro_batch_min_tokens
        self.membership_changes: list = []   # the job's MembershipChange records (launch/runtime/membership.py)
        self.autoscaler = None               # launch/runtime/autoscale.py's, with autoscale=True
        self.queries: list[tuple] = []  # collectives asked for since the last step: (inbox kind, with events)
        self.scales: list[dict] = []    # membership changes asked for since the last step
        self.rebalance_interval, self.block_size = rebalance_interval, block_size
        self.num_attention_ranks = num_attention_ranks
        self.num_expert_ranks = 0        # kept current by the runtime (stats only)
        self.token_budget = worker.scheduler.max_num_batched_tokens
        self.step_id = 0
        self.num_split_steps = 0         # steps run as more than one micro-batch
        self.pending: deque[dict] = deque()
        self.req2rank: dict[str, int] = {}
        self.open_samples: dict[str, int] = {}   # request id -> its samples not finished yet
        # What is needed to move a request when its attention rank is lost: the request as assigned, the
        # tokens each of its samples has streamed, its finished samples, and its prompt-logprob entries sent.
        self.assigned: dict[str, dict] = {}
        self.streamed: dict[str, dict[int, list[int]]] = {}
        self.finished: dict[str, set[int]] = {}
        self.prompt_logprobs_sent: dict[str, int] = {}
        self.final_only: set[str] = set()    # requests added with "stream": False (see the module docstring)
        self.held: list[list] = []           # their outputs not yet put on the outbox, in order
        self.held_steps = 0                  # steps whose outputs are in held
        self.inflight = None             # the header of the step in flight (re-sent after a membership change)
        self.outbox = None               # set by the loop (step_protocol.py); regroup ends aborted moves here
        self.num_moved_requests = 0      # requests re-queued from a lost attention rank (recomputed)
        self.num_handed_over = 0         # requests a leaving attention rank handed over with their KV
        self.cache_aware = cache_aware
        self.cached: list[set[int]] = [set() for _ in range(num_attention_ranks)]   # each rank's cached keys
        self.num_routed_to_cache = 0     # requests sent to a rank that caches a prefix of their prompt
        self.reports = [replace(worker.report(), rank=r) for r in range(num_attention_ranks)]

    @property
    def has_work(self) -> bool:
        return bool(self.pending) or any(r.num_running or r.num_waiting for r in self.reports)

    def _assign(self) -> tuple[dict[str, list[dict]], dict[int, int]]:
        """The rank caching the longest prefix if it has room for the prompt, else the most free KV blocks; the
        free-block estimate is charged for what is assigned this step. -> (the new requests per rank, the prompt
        tokens they bring each rank: their prompts less its cached prefixes)."""
        free = [r.num_free_blocks for r in self.reports]
        out: dict[str, list[dict]] = {}
        tokens: dict[int, int] = {}
        while self.pending:
            req = self.pending.popleft()
            need = -(-len(req["prompt"]) // self.block_size)
            ranks = range(self.prefill_ranks or self.num_attention_ranks)   # PD: the prefill ranks take them in
            rank = max(ranks, key=lambda r: (free[r], -r))
            hit = self._cached_prefix(req["prompt"], req["params"].get("cache_salt")) if self.cache_aware \
                else [0] * self.num_attention_ranks
            if self.cache_aware and len(ranks) > 1:
                best = max(ranks, key=lambda r: (hit[r], free[r], -r))
                if hit[best] > hit[rank] and free[best] >= need:
                    rank = best
                self.num_routed_to_cache += hit[rank] > 0
            free[rank] -= need
            tokens[rank] = tokens.get(rank, 0) + len(req["prompt"]) - hit[rank] * self.block_size
            rid = req["id"]
            self.req2rank[rid] = rank
            self.open_samples.setdefault(rid, _num_samples(req))
            self.assigned[rid] = req
            self.streamed.setdefault(rid, {})
            self.finished.setdefault(rid, set())
            out.setdefault(str(rank), []).append(req)
        return out, tokens

    def plan_moves(self, aborted: frozenset[str] = frozenset()) -> list[list]:
        """PD: the moves of the next step (pd.plan_moves; aborted: request ids with an abort in the step)."""
        if not self.prefill_ranks:
            return []
        hits = self._prompt_hits if self.cache_aware else None
        moves, self.num_waiting_for_decode = plan_moves(self.reports, self.prefill_ranks,
                                                        self.worker.scheduler.max_num_seqs, self.req2rank, hits,
                                                        aborted)
        return moves

    def _prompt_hits(self, rid: str) -> list[int]:
        req = self.assigned[rid]
        return self._cached_prefix(req["prompt"], req["params"].get("cache_salt"))

    def _cached_prefix(self, prompt: list[int], salt: str | None = None) -> list[int]:
        """Per rank, how many leading full blocks of prompt its prefix cache holds (the last token never counts:
        it is always computed)."""
        keys = chain_hashes(prompt, self.block_size, limit=(len(prompt) - 1) // self.block_size, salt=salt)
        hits = []
        for cached in self.cached:
            n = 0
            while n < len(keys) and keys[n] in cached:
                n += 1
            hits.append(n)
        return hits

    def handle(self, cmd: tuple, aborts: dict[str, list[str]], outbox) -> bool:
        """Apply one inbox command; returns False on shutdown."""
        kind = cmd[0]
        if kind == "add":         # one request, or several (LLM.enqueue_all)
            for req in cmd[1:]:
                if not req.pop("stream", True):
                    self.final_only.add(req["id"])
                self.pending.append(req)
        elif kind == "abort":     # a request's id, or one sample's (f"{request id}#{index}")
            rid = cmd[1]
            base = request_of(rid)
            queued = next((i for i, r in enumerate(self.pending) if r["id"] == base), None)
            if queued is not None:    # not assigned (or moved back from a lost rank): the samples named end here
                if self._end_samples(self.pending[queued], rid, outbox):
                    self.pending[queued] = self._resumed(self.pending[queued])
                else:
                    del self.pending[queued]
            elif base in self.req2rank:
                aborts.setdefault(str(self.req2rank[base]), []).append(rid)
        elif kind == "stats":
            self.put(outbox, ("stats", self.stats()))
        elif kind == "scale":           # ("scale", request): a membership change, run by the loop
            self.scales.append(dict(cmd[1]))
        elif kind in ("comm_stats", "reset_prefix_cache"):     # collectives, run by the loop (comm_stats' events)
            self.queries.append((kind, len(cmd) > 1 and bool(cmd[1])))
        elif kind == "shutdown":
            return False
        else:
            raise ValueError(f"unknown inbox command {kind!r}")
        return True

    def take_scales(self) -> list[dict]:
        """The membership changes asked for since the last call, in order."""
        out, self.scales = self.scales, []
        return out

    def take_queries(self) -> list[tuple]:
        """The collectives asked for since the last call, in order: (inbox kind, comm_stats' events)."""
        out, self.queries = self.queries, []
        return out

    def next_step(self, aborts: dict[str, list[str]]) -> StepHeader:
        """The next step's header ("step": its id, capacity, new requests per rank, aborts per rank, is_decode,
        micro-batches, draft passes, PD moves, prefill ranks, decode passes). Moved requests decode on their new
        rank in this step.
        is_decode: no rank gets new requests or has any waiting, none moves any, and each running sequence has
        one token left to compute, plus its drafts (a running sequence has at least one, so that is when their
        sum is their count plus the drafts)."""
        self.step_id += 1
        new, prompt_tokens = self._assign()
        aborted = frozenset(request_of(i) for ids in aborts.values() for i in ids)
        moves = self.plan_moves(aborted)
        streams = self.kv_stream is not None and self.prefill_ranks and self.cache_aware
        pushes = self.kv_stream.plan(self.reports, self.prefill_ranks, self.req2rank, self._prompt_hits,
                                     lambda rid: -(-len(self.assigned[rid]["prompt"]) // self.block_size),
                                     aborted) if streams else []
        for src, dst, rids in moves:      # until dst reports: what it takes over, one token per sample
            samples = {rid: n for rid, _, n in self.reports[src].ready}
            rep = self.reports[dst]
            rep.max_next_tokens = min(self.token_budget, rep.max_next_tokens + sum(samples[r] for r in rids))
            rep.num_running += sum(samples[r] for r in rids)
        # Ranks that get new requests, or free seats by moving requests out, may admit up to a full token budget.
        capacity = max([r.max_next_tokens for r in self.reports] + [self.token_budget] * bool(new or moves))
        is_decode = not new and all(not r.num_waiting and r.max_next_tokens == r.num_running + r.num_draft_tokens
                                    for r in self.reports)
        split, decode_passes = step_shape(self.reports, prompt_tokens, self.token_budget, self.prefill_ranks,
                                          self.pass_planner, self.micro_batches, self.micro_batch_min_tokens)
        self.num_split_steps += split > 1
        off = self.disable_by_batch_size
        passes = 0 if off is not None and all(r.num_running >= off for r in self.reports) else self.draft_passes
        return StepHeader("step", self.step_id, capacity, new, aborts, is_decode and not moves, split, passes, moves,
                          self.prefill_ranks, decode_passes, pushes=pushes)

    def stats(self) -> dict:
        """Engine counters summed over attention ranks, as of the last step, per-rank free and total KV
        blocks, and the KV-cache bytes one token takes per layer (every attention rank holds the same layout)."""
        return {"steps": self.step_id,
                "micro_batches": self.micro_batches,
                "num_micro_batched_steps": self.num_split_steps,
                **{name: sum(getattr(r, field) for r in self.reports) for name, field in SUMMED.items()},
                "num_waiting": sum(r.num_waiting for r in self.reports) + len(self.pending),
                "free_kv_blocks": [r.num_free_blocks for r in self.reports],
                "kv_blocks": [r.num_blocks for r in self.reports],
                "num_routed_to_cache": self.num_routed_to_cache,
                "num_moved_requests": self.num_moved_requests,
                "num_handed_over_requests": self.num_handed_over,
                "spec_decode": spec_summed([r.spec_decode for r in self.reports]),
                "pd": {"prefill_ranks": self.prefill_ranks, **pd_summed([r.pd for r in self.reports]),
                       "requests_taken_over": [r.pd[0] if r.pd else 0 for r in self.reports],
                       "requests_waiting_for_decode": self.num_waiting_for_decode,
                       "multi_pass_steps": self.pass_planner.num_multi_pass_steps,
                       "prompt_tokens_computed": [r.prompt_tokens_computed for r in self.reports]},
                "kv_bytes_per_token_per_layer": self.worker.kv.bytes_per_token,
                "pool_ranks": self._pool_ranks(),
                "membership_changes": [c.to_dict() for c in self.membership_changes],
                "autoscale": None if self.autoscaler is None else self.autoscaler.summary()}

    def _pool_ranks(self) -> dict[str, int]:
        """Ranks per pool; with PD, the attention pool's prefill and decode ranks too."""
        pools = {"attention": self.num_attention_ranks, "expert": self.num_expert_ranks}
        if self.prefill_ranks:
            pools.update(prefill=self.prefill_ranks, decode=self.num_attention_ranks - self.prefill_ranks)
        return pools

    def collect(self, reports: list[StepReport], outbox) -> None:
        """Take one step's reports (in attention-rank order) and pass their outputs on. A request the step moved
        that its prefill rank reports ready again was refused by its decode rank: it is still there."""
        for src, _, rids in self.inflight.moves if self.inflight is not None else ():
            self.req2rank.update((rid, src) for rid in set(rids) & {r for r, _, _ in reports[src].ready})
        self.reports = reports
        self.pass_planner.observe(reports, self.prefill_ranks)
        self.inflight = None
        for cached, rep in zip(self.cached, reports):
            cached.difference_update(rep.cache_evicted)   # within a step, blocks are evicted (schedule) first
            cached.update(rep.cache_added)
        outputs = [out for rep in reports for out in rep.outputs]
        send = False
        for row_id, toks, finish, prompt_lps, *_ in outputs:
            base, index = split_sample_id(row_id)
            send = send or finish is not None or base not in self.final_only
            if base not in self.assigned:
                continue
            if toks:
                self.streamed[base].setdefault(index, []).extend(toks)
            if prompt_lps:
                self.prompt_logprobs_sent[base] = self.prompt_logprobs_sent.get(base, 0) + len(prompt_lps)
            if finish is None:
                continue
            self.finished[base].add(index)
            left = self.open_samples.get(base, 1) - 1
            if left > 0:
                self.open_samples[base] = left
            else:
                self._forget(base)
        if self.unheld:       # PD moves of a failed step that no rank held, and that did not finish in it
            back = [rid for rid in sorted(self.unheld) if rid in self.assigned and rid not in self.req2rank]
            self.unheld.clear()
            self.pending.extendleft(reversed([self._resumed(self.assigned[rid]) for rid in back]))
            self.num_moved_requests += len(back)
        if outputs:
            self.held += outputs
            self.held_steps += 1
        if send or self.held_steps >= HOLD_STEPS or not self.has_work:
            self.flush(outbox)

    def put(self, outbox, msg: tuple) -> None:
        """msg on the outbox after the outputs held back (so a request's messages keep their order)."""
        self.flush(outbox)
        outbox.put(msg)

    def flush(self, outbox) -> None:
        """Put the outputs held back on the outbox, if any."""
        if self.held:
            held, self.held, self.held_steps = self.held, [], 0
            outbox.put(("out", held))

    def _forget(self, rid: str) -> None:
        for table in (self.open_samples, self.req2rank, self.assigned, self.streamed, self.finished,
                      self.prompt_logprobs_sent):
            table.pop(rid, None)
        self.final_only.discard(rid)

    def regroup(self, keep: list[int], kv_blocks: list[int] = (), handover: dict[int, int] | None = None,
                held: dict[int, list[str]] | None = None, prefill_ranks: int | None = None) -> None:
        """The attention pool is now keep (keep[i]: the old rank of new rank i, -1 for a rank that joined; rank
        0 stays); kv_blocks: the KV pool size of each joining rank, in order. handover: old rank -> the old
        rank that took over its requests (a graceful scale-in: they stay there). Requests of the other ranks
        that left (lost) go back to the front of the queue, resumed from the tokens they have streamed (the
        step in flight never reported its tokens, so they are computed again); the in-flight header and every
        per-rank table move to the new rank numbers. Aborts for a moved request end it here. held: old rank -> the
        requests it holds, as the ranks said after a planned change failed between steps (a handover may have
        moved some, or dropped them on the way): each request is where a rank holds it, and one that no rank
        holds goes back to the queue like a lost rank's. prefill_ranks: PD's in the new pool (the plan's; None: the
        kept prefill ranks, 0 if no decode rank is kept)."""
        new_rank = {old: new for new, old in enumerate(keep) if old >= 0}
        handover = handover or {}
        header = self.inflight
        if held is not None:
            where = {rid: r for r, ids in held.items() for rid in ids}
            if header is None:
                for rid in self.req2rank:
                    self.req2rank[rid] = where.get(rid, -1)
            else:   # a step with PD moves failed: only its moved requests may be elsewhere than the leader thinks
                for rid in {rid for _, _, rids in header.moves for rid in rids} & set(self.req2rank):
                    if rid in where:
                        self.req2rank[rid] = where[rid]
                    else:    # in no rank's hands, or finished in the step: the re-sent step's reports tell which
                        del self.req2rank[rid]
                        self.unheld.add(rid)
        if header is not None:
            header.moves = header.pushes = []    # carried out or not, where each request is is settled above
        if self.kv_stream is not None:
            self.kv_stream.sent = {}             # rank numbers change; the next pushes start over
        if prefill_ranks is None:   # the kept ones (planning.plan_attention says so for every plan)
            kept_prefill = sum(0 <= old < self.prefill_ranks for old in keep)
            prefill_ranks = kept_prefill if kept_prefill < len(keep) else 0   # no decode rank left: colocated
        self.prefill_ranks = prefill_ranks
        for rid, rank in self.req2rank.items():
            if rank in handover:
                self.req2rank[rid] = handover[rank]
                self.num_handed_over += 1
        for src, dst in handover.items():   # until dst reports again: what it took over, as src last reported it
            s, d = self.reports[src], self.reports[dst]
            d.max_next_tokens = min(self.token_budget, d.max_next_tokens + s.max_next_tokens)
            d.num_running, d.num_waiting = d.num_running + s.num_running, d.num_waiting + s.num_waiting
            d.num_free_blocks -= s.num_blocks - s.num_free_blocks
        aborted: dict[str, list[str]] = {}   # request id -> what the aborts in flight to a lost rank name of it
        if header is not None:
            header.prefill_ranks = self.prefill_ranks
            header.decode_passes = header.decode_passes if self.prefill_ranks else 1   # no decode rank committed any
            for r, ids in header.aborts.items():
                for i in ids if int(r) not in new_rank else ():
                    aborted.setdefault(request_of(i), []).append(i)
            header.new_requests = {str(new_rank[int(r)]): reqs for r, reqs in header.new_requests.items()
                                   if int(r) in new_rank}
            header.aborts = {str(new_rank[int(r)]): ids for r, ids in header.aborts.items() if int(r) in new_rank}
        moved = []
        for rid, rank in list(self.req2rank.items()):
            if rank in new_rank:
                self.req2rank[rid] = new_rank[rank]
                continue
            del self.req2rank[rid]
            req = self.assigned[rid]
            if all(self._end_samples(req, i, self.outbox) for i in aborted.get(rid, ())):
                moved.append(self._resumed(req))
        self.pending.extendleft(reversed(moved))
        self.num_moved_requests += len(moved)
        blocks = iter(kv_blocks)
        fresh = [StepReport(new, n, 0, 0, num_blocks=n) for new, old in enumerate(keep) if old < 0
                 for n in [next(blocks)]]
        self.cached = [self.cached[old] if old >= 0 else set() for old in keep]
        joined = iter(fresh)
        self.reports = [self.reports[old] if old >= 0 else next(joined) for old in keep]
        for r, rep in enumerate(self.reports):
            rep.rank = r
        self.num_attention_ranks = len(keep)

    def _end_samples(self, req: dict, some_id: str, outbox) -> bool:
        """End the open samples of req (no rank holds it) that some_id names: a request's id names each, a
        sample's that one. -> whether a sample of req is still open (else the request is forgotten)."""
        rid, n = req["id"], _num_samples(req)
        ids, done = sample_ids(rid, n), self.finished.setdefault(rid, set())
        ending = [i for i in range(n) if i not in done and some_id in (rid, ids[i])]
        if ending:
            self.put(outbox, ("out", [[ids[i], [], "abort", None, None, None] for i in ending]))
        done.update(ending)
        if len(done) < n:
            self.open_samples[rid] = n - len(done)
            return True
        self._forget(rid)
        return False

    def _resumed(self, req: dict) -> dict:
        """req to assign again (its rank was lost, or a sample of it ended while queued): resumed from the tokens
        its open samples streamed (a request of several samples none of which streamed or ended starts afresh)."""
        rid, n = req["id"], _num_samples(req)
        done, streamed = self.finished.get(rid, set()), self.streamed.get(rid, {})
        resume = {str(i): streamed.get(i, []) for i in range(n) if i not in done} if streamed or done or n == 1 else {}
        return dict(req, resume=resume, prompt_logprobs_sent=self.prompt_logprobs_sent.get(rid, 0))


def _num_samples(req: dict) -> int:
    p = req["params"]
    return p.get("best_of") or p.get("n", 1)
