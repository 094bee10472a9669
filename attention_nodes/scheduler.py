"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1 style).

Every step has one token budget shared by all sequences: a decode is just a
sequence with one new token, a prefill chunk is a sequence with many. Running
sequences are served first (oldest first); waiting ones are admitted FIFO with
what is left. When KV blocks run out, the newest running sequence is preempted:
its blocks are freed and it later recomputes all its tokens as a prefill.

Invariant: `running` is sorted by arrival and every running arrival is below
every waiting arrival, so the newest running sequence is always `running[-1]`.

Policy "priority" (vLLM's `scheduling_policy`): the waiting queue is ordered by (SamplingParams.priority, arrival),
a lower priority first, and the running sequence preempted when blocks run out is the one with the highest
(priority, arrival), wherever it is in `running`: one already scheduled in this step gives its tokens and blocks
back. `running` keeps the order of admission, so the invariant above holds only under "fcfs".

A prefill rank of PD (`prefill_only`) runs prompts only: a sequence whose prefill is done (Sequence.prefilled)
stays in `running`, holding its blocks and its seat, but is not scheduled again; it waits there until the
leader moves it to a decode rank (attention_nodes/pd.py).

Prefix caching (`enable_prefix_caching`): a sequence being admitted starts from the longest run of its full
blocks already cached, on the device pool and then on the host tier, and computes at least its last token.
Every full block a step computes is registered, so it can be found again once its sequence is done.
"""
from __future__ import annotations

from collections import deque
from typing import Literal

from attention_nodes.block_pool import BlockPool, chain_hashes
from attention_nodes.sequence import Sequence, SequenceStatus
from attention_nodes.step_plan import ScheduledSeq, SchedulerOutput

POLICIES = ("fcfs", "priority")


class Scheduler:
    """Owns the waiting queue and the running list; allocates KV blocks from `block_pool`."""

    def __init__(self, block_pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = False, policy: Literal["fcfs", "priority"] = "fcfs") -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Scheduler {name}={value!r} is invalid: pass an integer >= 1")
        if policy not in POLICIES:
            raise ValueError(f"Scheduler policy={policy!r} is unknown: pass one of {', '.join(POLICIES)}")
        self.by_priority = policy == "priority"
        self.block_pool = block_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._live: dict[str, Sequence] = {}  # request_id -> unfinished seq
        self._last_arrival: int | None = None
        self.enable_prefix_caching = enable_prefix_caching
        self.num_prefix_queries = 0      # tokens of admitted sequences looked up in the prefix cache
        self.num_prefix_hits = 0         # of those, tokens found cached (device or host) and not computed
        self.num_prompt_tokens_computed = 0  # prompt positions run through the model (recomputes included)
        self.prefill_only = False        # PD's prefill rank: prefilled sequences wait to move (module docstring)

    running = property(lambda self: self._running, doc="RUNNING seqs in admission order (fcfs: oldest first).")
    waiting = property(lambda self: self._waiting, doc="WAITING seqs (deque), next to admit first.")
    num_running = property(lambda self: len(self._running))
    num_waiting = property(lambda self: len(self._waiting))
    has_work = property(lambda self: bool(self._running or self._waiting))
    num_draft_tokens = property(lambda self: sum(len(s.spec_tokens) for s in self._running),
                                doc="Draft tokens the running sequences carry into the next step.")

    def add(self, seq: Sequence) -> None:
        """Queue a new WAITING sequence. Arrivals must increase and request ids be unique."""
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"request {seq.request_id!r} is not fresh (status={seq.status.name}, "
                             f"num_computed_tokens={seq.num_computed_tokens}): add new sequences only")
        if seq.request_id in self._live:
            raise ValueError(f"request_id={seq.request_id!r} is already queued or running: use a unique id")
        if self._last_arrival is not None and seq.arrival <= self._last_arrival:
            raise ValueError(f"request {seq.request_id!r} has arrival={seq.arrival} but the last one added "
                             f"had {self._last_arrival}: arrival numbers must increase")
        needed = self.block_pool.blocks_needed(seq.num_tokens)
        if needed > self.block_pool.num_blocks:
            raise ValueError(f"request {seq.request_id!r} has {seq.num_tokens} prompt tokens needing {needed} "
                             f"KV blocks but the pool has {self.block_pool.num_blocks}: shorten the prompt")
        self._last_arrival = seq.arrival
        self._live[seq.request_id] = seq
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """seq into the waiting queue: at its tail, or by priority in its place (found from the tail: a new
        arrival of the common priority goes last at once)."""
        i = len(self._waiting)
        if self.by_priority:
            while i and _rank(self._waiting[i - 1]) > _rank(seq):
                i -= 1
        self._waiting.insert(i, seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop a waiting or running request (every unfinished sample of it, by the request's id; or one sample,
        by its own), free its blocks; returns the sequences dropped ([] if it is unknown or already done)."""
        seqs = [s for s in self._live.values() if s.group_id == request_id] if request_id not in self._live \
            else [self._live[request_id]]
        for seq in seqs:
            del self._live[seq.request_id]
            if seq.status is SequenceStatus.WAITING:
                self._waiting.remove(seq)
            else:
                self._running.remove(seq)
            self._release(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        return seqs

    def parked(self) -> list[Sequence]:
        """A prefill rank's sequences that are done with their prefill and wait to move, in admission order."""
        return [s for s in self._running if s.prefilled] if self.prefill_only else []

    def take_over(self, running: list[Sequence], waiting: list[Sequence], next_arrival) -> None:
        """Sequences handed over from another rank (attention_nodes/handover.py): running ones, holding their
        blocks already, join `running` after the current ones; waiting ones (holding none) the waiting queue's
        tail. Arrivals are renumbered with next_arrival() (the current waiting ones too, after the new running
        ones) so that under fcfs running stays sorted and below every waiting arrival; under priority the waiting
        queue is sorted again by (priority, arrival)."""
        for seq in running + waiting:
            if seq.request_id in self._live:
                raise ValueError(f"request_id={seq.request_id!r} handed over is already here")
            self._live[seq.request_id] = seq
        self._running += running
        self._waiting.extend(waiting)
        for seq in running + list(self._waiting):
            seq.arrival = next_arrival()
            self._last_arrival = seq.arrival
        if self.by_priority:
            self._waiting = deque(sorted(self._waiting, key=_rank))

    def fork(self, sched: ScheduledSeq, generators: list) -> list[ScheduledSeq]:
        """Make samples 1.. of a request whose first sample is being drawn in this step (sched: its entry in the
        step's output, before update). Each shares the request's blocks (one more reference each) and joins
        `running` right after it; the caller adds the returned entries to the step's output and draws one token
        for each. generators: one per new sample."""
        parent = sched.seq
        assert parent.needs_fork and sched.needs_sample and parent.status is SequenceStatus.RUNNING
        children = [parent.fork(i, g) for i, g in enumerate(generators, start=1)]
        parent.forked = True
        at = self._running.index(parent) + 1
        self._running[at:at] = children
        for child in children:
            self.block_pool.incref(child.block_table)
            self._live[child.request_id] = child
        return [ScheduledSeq(child, sched.num_new_tokens, sched.start, is_fork=True) for child in children]

    def schedule(self, budget: int | None = None) -> SchedulerOutput:
        """Pick this step's work within max_num_batched_tokens tokens (or budget, when smaller: a PD decode pass
        after the step's first, bound by the header's capacity) and max_num_seqs sequences."""
        pool = self.block_pool
        budget = self.max_num_batched_tokens if budget is None else min(budget, self.max_num_batched_tokens)
        out = SchedulerOutput.empty()
        # Step 1: running sequences in admission order; preempt the newest (priority: the least urgent) when blocks
        # run out.
        i = 0
        reserve = self._later_needs() if any(s.spec_tokens for s in self._running) else None
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            if self.prefill_only and seq.prefilled:
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # a decode with drafts runs them too, as many as the budget leaves room for once each later running
            # sequence has its one token, and only when the blocks they reach are free now beside those the later
            # ones' next tokens need: drafts never cost another sequence its blocks or its token
            drafts = seq.spec_tokens[:max(0, budget - len(self._running) + i)] if num_new == 1 else []
            if drafts and not self._drafts_fit(seq, len(drafts), reserve[i + 1]):
                drafts = []
            num_new += len(drafts)
            assert num_new > 0, f"running request {seq.request_id!r} has no token to compute"
            shared_tail = self._is_shared_tail(seq)   # again after each preemption: a preempted sample held it
            num_missing = self._num_missing_blocks(seq, num_new) + shared_tail
            while not pool.can_allocate(num_missing) and (victim := self._victim()) is not seq:
                at, tokens = self._preempt(victim, out)
                i -= at < i           # (priority) one scheduled before this one: its tokens come back
                budget += tokens      # (`reserve` then runs one entry behind for the step: fewer drafts, no harm)
                shared_tail = self._is_shared_tail(seq)
                num_missing = self._num_missing_blocks(seq, num_new) + shared_tail
            if not pool.can_allocate(num_missing):
                self._preempt(seq, out)  # the seq itself: its blocks go to older (or more urgent) ones
                break
            if shared_tail:   # copy on write: this step writes into a block other samples hold
                tail = seq.num_computed_tokens // pool.block_size
                seq.replace_block(tail, pool.copy_block(seq.block_table[tail]))
                num_missing -= 1
            if num_missing:
                seq.block_table.extend(pool.allocate(num_missing))
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens, drafts=drafts))
            budget -= num_new
            i += 1
        # Step 2: admit waiting sequences FIFO, unless this step was already short of blocks. A request that
        # will fork takes a seat per sample now, so running never outgrows max_num_seqs when it forks. One whose
        # grammar still compiles is passed over (vLLM's WAITING_FOR_FSM): the others go ahead of it.
        num_seats = sum(map(seats_of, self._running))
        ready = (s for s in list(self._waiting) if not s.compiling)
        while not out.preempted and budget > 0 and (seq := next(ready, None)) is not None \
                and num_seats + seats_of(seq) <= self.max_num_seqs:
            assert seq.num_computed_tokens == 0 and not seq.block_table
            if not self._admit(seq, budget):
                break  # FIFO: no skipping ahead of the head
            self._waiting.remove(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seq.block_table.extend(pool.allocate(self._num_missing_blocks(seq, num_new)))
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            out.scheduled.append(ScheduledSeq.from_seq(seq, num_new))
            budget -= num_new
            num_seats += seats_of(seq)
        assert out.num_tokens <= self.max_num_batched_tokens and len(out.scheduled) <= self.max_num_seqs
        return out

    def max_next_tokens(self) -> int:
        """Upper bound on the tokens the next schedule() runs if no request is added before it: what the
        running sequences have left plus what the waiting ones that could still be admitted bring."""
        total = sum(s.num_tokens - s.num_computed_tokens + len(s.spec_tokens) for s in self._running)
        free_seats = self.max_num_seqs - len(self._running)
        for seq in self._waiting:
            if free_seats <= 0 or total >= self.max_num_batched_tokens:
                break
            total += seq.num_tokens - seq.num_computed_tokens
            free_seats -= 1
        return min(total, self.max_num_batched_tokens)

    def update(self, out: SchedulerOutput, sampled: list, eos_token_ids: frozenset[int],
               max_model_len: int) -> list[tuple[Sequence, list[int] | None]]:
        """Record a finished step. `sampled[i]` is what `out.scheduled[i]` emits: a token id, or a list of them
        (speculative decoding: its accepted drafts, then the target's token), or None if not needs_sample.

        Returns (seq, tokens appended) for each sequence that produced tokens, in schedule order (None: a
        max_tokens=0 request that finished once its prompt was scored). Tokens past a finish (EOS, a stop token,
        max_tokens, the context limit) are dropped.
        Finished sequences leave `running` and give their blocks back; a sequence whose drafts were rejected is
        rolled back: only the KV of its last token and the drafts accepted counts as computed, and the blocks
        that only the rejected ones needed go back to the pool.
        """
        if len(sampled) != len(out.scheduled):
            raise ValueError(f"len(sampled)={len(sampled)} but {len(out.scheduled)} sequences were scheduled")
        produced: list[tuple[Sequence, list[int] | None]] = []
        for sched, token in zip(out.scheduled, sampled):
            seq = sched.seq
            if seq.is_finished:
                continue  # aborted between schedule() and update()
            assert seq.num_computed_tokens == sched.start, f"request {seq.request_id!r} updated twice"
            if (token is None) == sched.needs_sample:
                raise ValueError(f"sampled token {token!r} for request {seq.request_id!r} does not match "
                                 f"needs_sample={sched.needs_sample}")
            tokens = None if token is None else [token] if isinstance(token, int) else list(token)
            if tokens is not None and not 1 <= len(tokens) <= len(sched.drafts) + 1:
                raise ValueError(f"request {seq.request_id!r} emitted {len(tokens)} tokens from "
                                 f"{len(sched.drafts)} drafts: pass 1 to {len(sched.drafts) + 1}")
            if not sched.is_fork:
                self.num_prompt_tokens_computed += max(0, min(sched.start + sched.num_new_tokens,
                                                              seq.num_prompt_tokens) - sched.start)
            # the chunk's KV holds the accepted drafts only: a rejected one's slot is computed again next step
            seq.num_computed_tokens += sched.num_new_tokens - len(sched.drafts) + (
                len(tokens) - 1 if sched.drafts else 0)
            seq.spec_tokens = []
            if sched.drafts:
                self._roll_back(seq)
            if tokens is not None and seq.params.max_tokens == 0:        # scored its prompt; generates nothing
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
                produced.append((seq, None))
            elif tokens is not None:
                appended = []
                for t in tokens:
                    appended.append(t)
                    if seq.append_token(t, eos_token_ids, max_model_len) is not None:
                        break
                if len(appended) < len(tokens):    # finished inside the accepted drafts: the rest's KV is dropped
                    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                produced.append((seq, appended))
            if self.enable_prefix_caching:     # after the append: the accepted drafts' blocks hold those tokens
                self.register_full_blocks(seq)
            if seq.is_finished:
                self._running.remove(seq)
                del self._live[seq.request_id]
                self._release(seq)
        return produced

    def _roll_back(self, seq: Sequence) -> None:
        """After a speculative step: free the blocks past those the sequence's computed tokens and its next one
        need (num_computed_tokens already counts only the accepted drafts)."""
        keep = self.block_pool.blocks_needed(seq.num_computed_tokens + 1)
        if len(seq.block_table) > keep:
            extra = seq.block_table[keep:]
            seq.replace_blocks(seq.block_table[:keep])   # a new version: the rank's InputBatch rewrites its row
            self.block_pool.free(reversed(extra))

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Start seq from its longest cached prefix if the blocks for its first chunk can be had; False (and
        nothing changes) if they cannot. Sets block_table to the cached blocks (host ones restored into fresh
        blocks) and num_computed_tokens past them; the caller allocates the rest of the chunk."""
        pool, host = self.block_pool, self.block_pool.host
        device_hits: list[int] = []
        keys: list[int] = []
        num_host = 0
        # Prompt logprobs score every prompt position, so such requests compute theirs (vLLM does the same).
        lookup = self.enable_prefix_caching and seq.params.prompt_logprobs is None
        if lookup:
            keys = chain_hashes(seq.token_ids, pool.block_size, seq.block_keys,   # the last token is computed
                                limit=(seq.num_tokens - 1) // pool.block_size, salt=seq.params.cache_salt)
            device_hits = pool.lookup(keys)
            if host is not None:
                num_host = host.match(keys[len(device_hits):])
        num_cached = (len(device_hits) + num_host) * pool.block_size
        num_new = min(seq.num_tokens - num_cached, budget)
        num_missing = pool.blocks_needed(num_cached + num_new) - len(device_hits)
        if pool.num_free_blocks - pool.num_revived(device_hits) < num_missing:
            return False
        pool.take(device_hits)
        seq.replace_blocks(list(device_hits))
        if num_host:
            host_keys = keys[len(device_hits):len(device_hits) + num_host]
            host.pin(host_keys)   # allocating may save evicted blocks to the host: not over these
            restored = pool.allocate(num_host)
            host.restore(host_keys, restored)
            for b, key in zip(restored, host_keys):
                pool.register(b, key)
            seq.replace_blocks(seq.block_table + restored)
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = len(seq.block_table)
        if seq.num_cached_tokens is None:       # the first admission's (a recompute's hits are its own blocks)
            seq.num_cached_tokens = num_cached
        if lookup:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += num_cached
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the full blocks computed so far findable by later sequences."""
        full = seq.num_computed_tokens // self.block_pool.block_size
        if full <= seq.num_registered_blocks:
            return
        keys = chain_hashes(seq.token_ids, self.block_pool.block_size, seq.block_keys, limit=full,
                            salt=seq.params.cache_salt)
        for i in range(seq.num_registered_blocks, full):
            self.block_pool.register(seq.block_table[i], keys[i])
        seq.num_registered_blocks = full

    def _drafts_fit(self, seq: Sequence, num_drafts: int, reserved: int) -> bool:
        """The blocks a decode of seq with num_drafts drafts needs beyond its own are free (with one more for a
        copy on write) beside `reserved` more, and the chunk's blocks fit the pool."""
        pool = self.block_pool
        needed = pool.blocks_needed(seq.num_computed_tokens + 1 + num_drafts)
        return needed <= pool.num_blocks and pool.can_allocate(
            max(0, needed - len(seq.block_table)) + self._is_shared_tail(seq) + reserved)

    def _later_needs(self) -> list[int]:
        """Per running index i, the blocks the next tokens of the running sequences from i on need that they do
        not hold (a new block, or an own copy of a shared tail); one more entry past the end, 0."""
        out = [0] * (len(self._running) + 1)
        for i in range(len(self._running) - 1, -1, -1):
            seq = self._running[i]
            out[i] = out[i + 1] + self._num_missing_blocks(seq, 1) + self._is_shared_tail(seq)
        return out

    def _is_shared_tail(self, seq: Sequence) -> bool:
        """The block this step's first token goes into exists and other samples hold it too (only the partly
        filled last block of a forked request's prompt can be: full blocks are never written again)."""
        i = seq.num_computed_tokens // self.block_pool.block_size
        return i < len(seq.block_table) and self.block_pool.refcount(seq.block_table[i]) > 1

    def _num_missing_blocks(self, seq: Sequence, num_new: int) -> int:
        needed = -(-(seq.num_computed_tokens + num_new) // self.block_pool.block_size)
        if needed > self.block_pool.num_blocks:
            raise RuntimeError(f"request {seq.request_id!r} needs {needed} KV blocks but the pool has "
                               f"{self.block_pool.num_blocks}: raise num_blocks or lower max_model_len")
        return max(0, needed - len(seq.block_table))

    def _victim(self) -> Sequence:
        """The running sequence to preempt first: the newest, or by priority the least urgent."""
        return max(self._running, key=_rank) if self.by_priority else self._running[-1]

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> tuple[int, int]:
        """Send a running sequence back to wait (its KV dropped, recomputed when admitted again); listed in
        out.preempted. -> (its index in `running`, the tokens of its entry in out.scheduled taken back: 0 unless
        it was scheduled earlier in this step, which only the priority policy does)."""
        at = self._running.index(victim)
        del self._running[at]
        assert self.by_priority or all(s.arrival <= victim.arrival for s in self._running), \
            "running is not sorted by arrival"
        tokens = 0
        if self.by_priority and (k := next((k for k, e in enumerate(out.scheduled) if e.seq is victim), None)) \
                is not None:
            tokens = out.scheduled.pop(k).num_new_tokens
        self._release(victim)
        victim.num_computed_tokens = 0
        victim.spec_tokens = []
        victim.draft_computed = 0
        victim.num_registered_blocks = 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        if self.by_priority:
            self._enqueue(victim)
        else:
            self._waiting.appendleft(victim)     # its arrival is below every waiting one's
        out.preempted.append(victim)
        return at, tokens

    def _release(self, seq: Sequence) -> None:
        self.block_pool.free(reversed(seq.block_table))   # the tail is reused first, the shared head kept longest
        seq.replace_blocks([])


def _rank(seq: Sequence) -> tuple[int, int, int]:
    """The priority policy's order: a lower priority first, then the earlier arrival, then the sample."""
    return seq.params.priority, seq.arrival, seq.sample_index


def seats_of(seq: Sequence) -> int:
    """Running seats seq takes: one per sample while its samples are still to be forked, else one."""
    return seq.params.num_samples if seq.needs_fork else 1
