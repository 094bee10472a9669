"""One attention rank's step: admit requests, schedule, run the forward (joining every layer's
dispatch/combine), sample, and report progress to the leader."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import replace

import torch

from comm.control import StepReport

from .batch import ForwardBatch, order_for_batch, split_micro_batches
from .block_pool import BlockPool
from .handover import pack_sequences, receive_sequences
from .input_batch import InputBatch
from .kv_cache import KVCache
from .logits_process import shape_logits, token_logprobs
from .model import AttentionModel, MoEContext
from .passes import StretchedMoE
from .pd import TransferStats, apply_moves, apply_pushes, prefilling_requests, ready_requests
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, sample_ids, seeded_generator
from .speculation import Drafter, SpecStats, SpeculativeConfig, emit
from .structured import Grammars

logger = logging.getLogger("afserve")


class AttentionWorker:
    def __init__(self, rank: int, model: AttentionModel, kv: KVCache, scheduler: Scheduler, moe: MoEContext,
                 max_model_len: int, device: torch.device, micro_batches: int = 1,
                 speculative: SpeculativeConfig | None = None, draft=None, mtp=None, grammars=None):
        """draft: speculative method "draft_model"'s DraftModel; mtp: method "mtp"'s MTPProposer; grammars: makes
        the rank's structured.Grammars, at the first request with structured outputs (None: none come)."""
        self.rank = rank
        self.micro_batches = micro_batches
        self.model, self.kv, self.scheduler, self.moe = model, kv, scheduler, moe
        self.sampler = Sampler()
        self.eos = frozenset(model.spec.eos_token_ids)
        self.max_model_len = max_model_len
        self.device = device
        # Per-sequence block tables kept across steps; each step's batches are built from them.
        self.inputs = InputBatch(kv.block_size, kv.num_blocks, max_model_len, device, 2 * scheduler.max_num_seqs)
        self._arrivals = 0
        self._aborted: list[list] = []
        self.num_partial_chunks = 0
        self.report_work = False    # each report carries its step's work (the leader's autoscaler reads it)
        self.num_preemptions = 0
        self.num_kv_blocks_received = 0   # KV blocks handed over by ranks that left (attention_nodes/handover.py)
        self.pd_stats = TransferStats()      # PD: requests and KV taken over from prefill ranks so far
        # Re-forming the job re-sends the step in flight (launch/runtime/step_protocol.py): the last step begun and
        # finished, its report, and a batch whose forward has not passed every exchange yet.
        self.started_step = self.done_step = 0
        self.last_report: StepReport | None = None
        self.pass_reports: list[StepReport] = []   # the started step's committed PD decode passes' reports
        self._inflight = None
        self.is_decode_step = False   # the last step run computed only one-token decodes (or nothing)
        self.forward_s = 0.0          # the last step's forward (wall seconds): the rest of a step is host work
        self.drafter = None if speculative is None else Drafter(speculative, max_model_len, draft)
        self.spec_stats = SpecStats()
        self.mtp = mtp
        self._committed = None   # method "mtp": the last committed step's chunks and emitted tokens, for its passes
        self._make_grammars, self._grammars = grammars, None
        self._compiling: list[tuple[str, Future, Sequence]] = []    # sequences whose grammars compile (`_reap`)

    def adopt(self, moe: MoEContext) -> None:
        """A new generation of the job: reach the experts through its dispatcher and placement."""
        self.moe = moe

    def detach(self) -> None:
        """This rank left its generation: drop the data plane (the next generation brings its own)."""
        self.moe = None

    def set_placement(self, placement) -> None:
        """A live re-placement: choose replicas by the new balancer/placement.py Placement from the next step."""
        self.moe.policy.set_placement(placement)

    def next_arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    def hand_over(self) -> tuple[dict, torch.Tensor]:
        """This rank leaves: its live sequences and their KV blocks (copied out), for the rank that takes them
        over. They are dropped here at once (no output), so that if the change fails before the other rank has
        taken them, no rank holds them and the leader resumes them elsewhere (held_requests)."""
        packed = pack_sequences(self)
        for rid in self.held_requests():
            self.scheduler.abort(rid)
        self.inputs.clear()
        return packed

    def held_requests(self) -> list[str]:
        """The ids of the requests this rank holds (running or waiting; a request's, not its samples')."""
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        return sorted({s.group_id or s.request_id for s in seqs})

    def begin_step(self, header, transfer, sent_meta=None) -> None:
        """A new step's header: take its new requests and aborts (and abort those whose grammars failed to compile
        here), then (PD) play this rank's role and its part of the header's moves and pushes (transfer: a callable
        giving the KVTransfer, asked only when there are some; sent_meta: pd.apply_moves')."""
        self.add_requests(header.requests_for(self.rank))
        self.abort(header.aborts_for(self.rank))
        self._reap()
        self.scheduler.prefill_only = self.rank < header.prefill_ranks
        if header.moves:
            apply_moves(self, header.moves, transfer(), sent_meta)
        if header.pushes:
            apply_pushes(self, header.pushes, transfer())

    def take_over(self, transfer, src: int) -> None:
        """Take the sequences leaving rank src hands over through transfer (with their KV blocks where they fit;
        those this rank's prefix cache holds are not sent)."""
        _, take, _ = receive_sequences(self, transfer, src)
        self.num_kv_blocks_received += len(take.need) + len(take.have)

    @property
    def block_pool(self) -> BlockPool:
        return self.scheduler.block_pool

    def add_requests(self, requests: list[dict]) -> None:
        """requests: {"id": str, "prompt": [int], "params": SamplingParams.to_dict()} (validated by the front).
        A request moved here from a lost attention rank also has "resume": {sample index: [tokens generated
        so far]} (the samples still open; empty when none was drawn yet) and "prompt_logprobs_sent": how many
        prompt-logprob entries were already reported; it is recomputed from prompt plus those tokens and goes
        on from there. Only its first resumed sample reports the prompt logprobs still unsent, as a request's
        prefill does before it forks."""
        for r in requests:
            params = SamplingParams.from_dict(r["params"])
            resume = sorted((int(i), toks) for i, toks in r.get("resume", {}).items())
            compiling = self._compiles(r["id"], params) if params.structured_outputs else None
            if params.structured_outputs and compiling is None:
                ids = sample_ids(r["id"], params.num_samples)
                ids = [ids[i] for i, _ in resume] if resume else ids      # a resumed request: its open samples
                self._aborted += [[i, [], "abort", None, None, None] for i in ids]
                continue
            sent = r.get("prompt_logprobs_sent", 0)
            for i, toks in resume or [(None, None)]:
                arrival = self.next_arrival()
                seq = Sequence.from_request(r["id"], r["prompt"], params, arrival, self.device) if i is None else \
                    Sequence.resumed(r["id"], i, r["prompt"], toks, params, arrival, self.device)
                _skip_prompt_logprobs(seq, sent)
                sent = len(r["prompt"])          # every entry, for the samples after the first
                if compiling is not None:        # not scheduled before `_reap` has seen its grammar compiled
                    seq.compiling = True
                    self._compiling.append((r["id"], compiling, seq))
                self.scheduler.add(seq)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for seq in self.scheduler.abort(rid):
                # Aborted before it forked, a request still ends each of its samples.
                ids = sample_ids(seq.group_id, seq.params.num_samples) if seq.needs_fork else [seq.request_id]
                self._aborted += [[i, [], "abort", None, None, None] for i in ids]

    def step(self, capacity: int, micro_batches: int = 1, stretch: int = 1) -> StepReport:
        """One forward. capacity: the header's bound on this step's tokens (sizes the dispatch messages; a PD
        decode rank's later passes schedule within it); micro_batches: the header's number of ping-pong
        micro-batches for this step (at most the configured); stretch: a PD prefill rank's forward in a step of
        that many decode passes, its MoE layers spread over their rounds (attention_nodes/passes.py).
        Nothing is committed until the forward has passed every exchange: when one fails (a lost peer), the
        next call runs the same scheduled batch again (the block copies, done before the forward, are not
        redone)."""
        t0, waited0 = self.moe.dispatcher.stats.now(), self.moe.waited_s    # (synced with timing_sync on CUDA)
        if self._inflight is None:
            out = order_for_batch(self.scheduler.schedule(capacity))
            host = self.block_pool.host
            if host is not None:
                self.kv.copy_blocks(host.take_ops())   # saves before this step overwrites, restores before it reads
            copies = self.block_pool.take_copies()
            self.kv.copy_device_blocks(copies)   # copy on write, after the saves
            if self.mtp is not None:
                self.mtp.copy_blocks(copies)
            self._inflight = out
        out = self._inflight
        self.is_decode_step = out.is_decode
        assert out.num_tokens <= capacity, f"rank {self.rank}: {out.num_tokens} tokens > step capacity {capacity}"
        self.moe.dispatcher.set_capacity(capacity)
        self.inputs.begin_step()
        batches = [self.inputs.prepare(part, self.model.kernel_backend)
                   for part in split_micro_batches(out.scheduled, micro_batches)]
        logits = self._forward(batches, stretch)
        self._inflight = None
        # The logit rows hold, per scheduled sequence in order, its prompt-logprob rows, then its sampled row (with
        # speculative drafts: one per draft, then the last token's).
        to_sample, sample_rows, scored, row = [], [], [], 0
        for s in out.scheduled:
            positions = s.seq.prompt_logprob_positions(s.start, s.start + s.num_new_tokens)
            if positions:
                scored.append((s.seq, positions, row))
                row += len(positions)
            if s.needs_sample:
                to_sample.append(s)
                sample_rows.append(row)
                row += 1 + len(s.drafts)
        if scored:
            score_prompt_tokens(logits, scored)
        ran = list(out.scheduled)     # the chunks of the forward, in the order of its rows (before forks join)
        # A request drawing several samples forks at its first draw: each sample gets the same logit row.
        forking = [(s, r) for s, r in zip(to_sample, sample_rows) if s.seq.needs_fork]
        for s, r in forking:
            p = s.seq.params
            children = self.scheduler.fork(s, [None if p.seed is None else seeded_generator(p.seed + i, self.device)
                                               for i in range(1, p.num_samples)])
            out.scheduled += children
            to_sample += children
            sample_rows += [r] * len(children)
        drafts = [s.drafts for s in to_sample]
        if scored or forking:
            picked = [r + j for r, d in zip(sample_rows, drafts) for j in range(len(d) + 1)]
            logits = logits[torch.tensor(picked, dtype=torch.int64, device=logits.device)]
        seqs = [s.seq for s in to_sample]
        tokens, first_rows = self._emit(logits, seqs, drafts)
        token_lps = {}     # id(seq) -> the logprobs entries of its emitted tokens
        # best_of ranks samples by the sum of their tokens' logprobs, which the front adds up.
        wants = [i for i, q in enumerate(seqs) if q.params.logprobs is not None or q.params.num_samples > q.params.n]
        if wants:
            rows = torch.tensor([first_rows[i] + j for i in wants for j in range(len(tokens[i]))],
                                dtype=torch.int64, device=logits.device)
            entries = iter(token_logprobs(logits[rows], [t for i in wants for t in tokens[i]],
                                          [seqs[i].params.logprobs or 0 for i in wants for _ in tokens[i]]))
            token_lps = {id(seqs[i]): [next(entries) for _ in tokens[i]] for i in wants}
        it = iter(tokens)
        sampled = [next(it) if s.needs_sample else None for s in out.scheduled]
        self.num_partial_chunks += sum(not s.needs_sample for s in out.scheduled)
        self.num_preemptions += len(out.preempted)
        produced = self.scheduler.update(out, sampled, self.eos, self.max_model_len)
        for seq, toks in produced:
            if toks and seq.params.structured_outputs:
                Grammars.accept(seq, toks)
        if self.drafter is not None:
            self.spec_stats.add([len(d) for d in drafts], [len(t) for t in tokens])
            self.drafter.propose([seq for seq, toks in produced if toks], self.scheduler.num_running)
            if self.mtp is not None:
                self._committed = (ran, sampled[:len(ran)])
        outputs, self._aborted = self._aborted, []
        for seq, toks in produced:     # toks None: a max_tokens=0 request, done once its prompt is scored
            lps = token_lps.get(id(seq)) if toks is not None else None
            outputs.append([seq.request_id, toks or [], seq.finish_reason, _new_prompt_logprobs(seq),
                            None if lps is None else lps[:len(toks)], seq.num_cached_tokens])
        reported = {id(seq) for seq, _ in produced}
        outputs += [[seq.request_id, [], None, _new_prompt_logprobs(seq), None, seq.num_cached_tokens]
                    for seq, _, _ in scored if id(seq) not in reported]
        wall = self.moe.dispatcher.stats.now() - t0
        work = [sum(s.num_new_tokens for s in ran), sum(s.num_new_tokens * s.start + s.num_new_tokens
                                                        * (s.num_new_tokens + 1) // 2 for s in ran), row,
                len(ran)] if self.report_work else []
        return replace(self.report(outputs), wall_s=wall, busy_s=max(0.0, wall - (self.moe.waited_s - waited0)),
                       work=work)

    def _emit(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
              ) -> tuple[list[list[int]], list[int]]:
        """The tokens each sequence emits this step, and the logit row of each one's first token. logits: the
        sampled rows, per sequence 1 + its drafts. Without drafts, one draw per row; with them, verification
        (attention_nodes/speculation.py)."""
        if not seqs:
            return [], []
        structured = any(q.params.structured_outputs for q in seqs)
        if any(drafts):
            return emit(logits, seqs, drafts, self.eos, self.grammars() if structured else None)
        shaped = shape_logits(logits.float(), seqs, self.eos)
        if structured:
            self.grammars().mask(shaped, seqs)
        tokens = self.sampler.sample(shaped, [q.params for q in seqs], [q.generator for q in seqs],
                                     self.inputs.sampling_columns(seqs))
        return [[t] for t in tokens], list(range(len(seqs)))

    def _compiles(self, request_id: str, params: SamplingParams) -> Future | None:
        """Start compiling a request's grammar as it arrives (the front compiled it already) on the grammars'
        worker thread, so this rank's steps go on meanwhile (the request waits, unscheduled, until `_reap` sees it
        compiled): its future, or None, and the log says why, if this rank cannot make grammars at all (no
        tokenizer in its model directory, say); the request is then aborted, not run unconstrained."""
        try:
            return self.grammars().prefetch(params.structured_outputs)
        except Exception as e:    # noqa: BLE001 (one request's grammar must not end the rank)
            self._refuse(request_id, e)
            return None

    def _refuse(self, request_id: str, why: Exception) -> None:
        logger.error("rank %d: request %r aborted: its structured_outputs do not compile here: %s", self.rank,
                     request_id, why)

    def _reap(self) -> None:
        """Between steps, before scheduling: the sequences whose grammars compiled may be scheduled; the requests
        whose grammars failed are aborted (their samples end "abort"; none was scheduled)."""
        still = []
        for rid, future, seq in self._compiling:
            if not future.done():
                still.append((rid, future, seq))
            elif future.exception() is None:
                seq.compiling = False
            elif seq.compiling:         # the request's first sequence to see it aborts them all
                self._refuse(rid, future.exception())
                for _, _, other in self._compiling:
                    other.compiling = other.compiling and (other.group_id or other.request_id) != rid
                self.abort([rid])
        self._compiling = still

    def grammars(self) -> Grammars:
        if self._grammars is None:
            if self._make_grammars is None:
                raise ValueError(f"rank {self.rank} was built without structured outputs")
            self._grammars = self._make_grammars()
        return self._grammars

    def draft(self, passes: int) -> StepReport:
        """After a committed step (last_report its report): the header's MTP passes (speculative method "mtp"),
        which propose the drafts of the next step -> the report with the next step's bound counting them. A rank
        whose drafter is off (disable_by_batch_size) joins them with no rows."""
        if not passes:
            return self.last_report
        ran, emitted = self._committed or ([], [])
        self._committed = None
        if self.drafter.off:
            ran = emitted = []
        self.mtp.propose(ran, emitted, self.drafter.rooms, passes, self.moe)
        s = self.scheduler
        return replace(self.last_report, max_next_tokens=s.max_next_tokens(), num_draft_tokens=s.num_draft_tokens)

    def join_exchanges(self, capacity: int, micro_batches: int = 1, draft_passes: int = 0, passes: int = 1) -> None:
        """Run a forward over no tokens: join every MoE layer's dispatch and combine of a step, as a rank with
        nothing scheduled does, and change nothing; passes: as many forwards (PD decode passes). A step re-sent
        after the job re-formed is run by every rank: one that had finished it joins its exchanges this way, so
        that the expert ranks and the ranks that had not finished it see every source
        (launch/runtime/step_protocol.py)."""
        self.moe.dispatcher.set_capacity(capacity)
        for _ in range(passes):
            self._forward([ForwardBatch.empty(self.device) for _ in range(micro_batches)])
        if draft_passes:
            self.mtp.join(draft_passes, self.moe)

    def _forward(self, batches: list[ForwardBatch], stretch: int = 1) -> torch.Tensor:
        """The model's forward over the micro-batches (stretch: over that many decode passes' rounds), its wall
        time kept in forward_s."""
        t0 = time.perf_counter()
        moe = self.moe
        if stretch > 1:
            assert len(batches) == 1, "a stretched forward runs one micro-batch"
            spec = self.model.spec
            moe = StretchedMoE(self.moe, spec.num_moe_layers - spec.num_mtp_layers, stretch)
        try:
            logits = self.model.forward(batches, self.kv, moe)
        except BaseException:
            if stretch > 1:
                moe.abandon()
            raise
        if stretch > 1:
            moe.close()
        self.forward_s = time.perf_counter() - t0
        return logits

    def report(self, outputs: list[list] | None = None) -> StepReport:
        s, pool = self.scheduler, self.block_pool
        added, evicted = pool.take_events()
        host = pool.host
        return StepReport(self.rank, pool.num_free_blocks, s.num_running, s.num_waiting,
                          s.max_next_tokens(), self.num_preemptions, self.num_partial_chunks, outputs or [],
                          pool.num_blocks, s.num_prefix_queries, s.num_prefix_hits, s.num_prompt_tokens_computed,
                          host.num_saved if host else 0, host.num_restored if host else 0, added, evicted,
                          self.num_kv_blocks_received, self.spec_stats.to_list() if self.drafter else [],
                          s.num_draft_tokens, ready_requests(self) if s.prefill_only else [],
                          self.pd_stats.to_list(), prefilling=prefilling_requests(self) if s.prefill_only else [])


def score_prompt_tokens(logits: torch.Tensor, scored: list[tuple[Sequence, range, int]]) -> None:
    """Append prompt logprobs to each sequence: for position p, log-softmax of row (row0 + p - positions.start)
    at prompt token p + 1, plus the sequence's top-k tokens there, with prompt token p + 1's rank (vLLM's)."""
    rows = torch.cat([torch.arange(r0, r0 + len(pos)) for _, pos, r0 in scored]).to(logits.device)
    targets = [t for seq, pos, _ in scored for t in seq.token_ids[pos.start + 1:pos.stop + 1]]
    ks = [seq.params.prompt_logprobs for seq, pos, _ in scored for _ in pos]
    entries = iter(token_logprobs(logits[rows], targets, ks, with_rank=True))
    for seq, pos, _ in scored:
        seq.prompt_logprobs.extend(next(entries) for _ in pos)


def _skip_prompt_logprobs(seq: Sequence, sent: int) -> None:
    """A moved request: its first `sent` prompt-logprob entries were reported already (placeholders here)."""
    if seq.prompt_logprobs is not None and sent:
        seq.prompt_logprobs = [None] * sent
        seq.num_prompt_logprobs_sent = sent


def _new_prompt_logprobs(seq: Sequence) -> list | None:
    """The prompt logprobs this rank has not reported yet (None when the request asked for none)."""
    if seq.prompt_logprobs is None or seq.num_prompt_logprobs_sent == len(seq.prompt_logprobs):
        return None
    new = seq.prompt_logprobs[seq.num_prompt_logprobs_sent:]
    seq.num_prompt_logprobs_sent = len(seq.prompt_logprobs)
    return new
