"""`direct` dispatch and combine over the same-host inboxes of comm/shm.py (transport shm on CPU, cuda_ipc on
GPUs): one message per (attention rank, expert rank) pair and direction, no collective.

A message's row count travels on the host, in its slot's flags, so a receiver slices its rows without reading
the device. With one expert rank a source sends its tokens in order (the count is the batch's size). With two or
more, which tokens go where is data: counted on the host (exact sizes: bincount, then `.tolist()`) or, with
in-band counts, placed on the device (comm/blocks.py, as the collective `direct` dispatcher does) into one place
per token of the batch for each expert rank, a place no token of the batch takes there holding slot -1: the host
posts the batch's size, which it knows, and the expert rank returns as many rows. No message is padded to the
step's capacity: a batch of n tokens sends each expert rank n rows, and gets n back from each. Reading counts
back is a stream synchronize per MoE layer and micro-batch on a GPU, and on the CPU it is free while exact sizes
copy and compute less: in-band counts are the default on CUDA (cuda_ipc) only.

With `count_words` (a balancer that plans from every attention rank's per-expert counts, least_loaded), each
attention rank may also own a counts inbox that the other attention ranks write their `[E]` counts into before
each dispatch: `gather_counts` carries them without a collective where the collective's all_gather would make the
host wait, which is over gloo (CPU ranks: ~1.5 ms per layer between two attention ranks on the 2-core VM; ranks
sharing a GPU: through host memory), or with `ipc_events` (then neither waits on the host). Between GPUs of their
own without events the NCCL all_gather stays: the inboxes' publish would add a stream synchronize per layer."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from .blocks import gather_rows, place_rows
from .dispatcher import Dispatcher, DispatchHandle, PendingDispatch, pack_rows, pack_rows_into, plan_rows, unpack_rows
from .shm import Inbox, Outlet, _StoreFence, ipc_events_refusal, make_shared_dir, slot_buffers


def counts_by_inbox(num_sources: int, backend: str, ipc_events: bool) -> bool:
    """Whether gather_counts goes through counts inboxes, from the job's process-group backend (the same on every
    rank): where the collective would make the host wait (gloo: CPU ranks, or GPU ranks of a node whose ranks
    share its GPUs, whose all_gather goes through host memory) or with CUDA IPC events (then nothing waits on
    the host); not over NCCL without events, which waits on no host, where the inboxes' publish would
    synchronize."""
    return num_sources > 1 and (backend == "gloo" or ipc_events)


class ShmDispatcher(Dispatcher):
    """`direct` semantics over the same-host inboxes of comm/shm.py: one message per (attention rank, expert
    rank) pair and direction, exact sizes, no collective. The payloads live in host shared memory on CPU
    (transport shm) and in device memory shared through CUDA IPC on a GPU (transport cuda_ipc). `control`
    (gloo) is used once, to set up. max_tokens bounds any source's tokens per call (the token budget).
    in_band: with two or more expert ranks, counts travel in-band (the module's docstring); None: on CUDA.
    Every rank must agree: the ranks' choices are gathered at set-up and in-band counts are used only if all
    chose them. ipc_events: on CUDA, slots signalled through CUDA IPC events instead of a stream synchronize per
    dispatch or combine (comm/shm.py CudaIpcBuffers; every rank the same). count_words: the `[E]` of gather_counts'
    messages between attention ranks (0: none; gather_counts is then the collective one)."""

    def __init__(self, group, hidden_size, top_k, dtype, device, num_sources, stats=None, ranks_per_node=None, *,
                 nodes=None, control, max_tokens: int, depth: int = 2, timeout_s: float = 600.0,
                 in_band: bool | None = None, ipc_events: bool = False, count_words: int = 0):
        super().__init__(group, hidden_size, top_k, dtype, device, num_sources, stats, ranks_per_node, nodes)
        W, S = self.world_size, num_sources
        self.max_tokens, self.depth, self.timeout_s = max_tokens, depth, timeout_s
        self.round = 0
        self._no_rows = torch.empty(0, dtype=torch.int64, device=self.device)
        self.buffers = buffers = slot_buffers(self.device, ipc_events)
        # Slot sizes: expert inboxes hold dispatched rows (with in-band counts up to max_tokens places), source
        # inboxes hold combined rows.
        expert_slot = max_tokens * self._row_bytes()
        source_slot = max_tokens * hidden_size * dtype.itemsize
        directory = make_shared_dir(control, self.rank)
        mine = self.device.type == "cuda" if in_band is None else in_band
        every = [torch.zeros(4, dtype=torch.int64) for _ in range(W)]
        gpu = self.device.index if self.device.type == "cuda" else -1
        dist.all_gather(every, torch.tensor([os.getpid(), int(mine), int(ipc_events), gpu]), group=control)
        refusal = ipc_events_refusal([(bool(e[2]), int(e[3])) for e in every]) if gpu >= 0 else None
        if refusal is not None:         # (every rank reaches the same answer, and raises it)
            raise RuntimeError(f"rank {self.rank}: {refusal}")
        self.in_band = W - S > 1 and all(int(e[1]) for e in every)
        peers = list(range(S, W)) if self.is_source else list(range(S))
        self.peer_pids = [int(every[p][0]) for p in peers]
        self.peer_names = [f"rank {p}" for p in peers]
        if self.is_source:  # receives combined rows from the experts, sends them tokens as sender `rank`
            self.inbox = Inbox(directory, self.rank, W - S, depth, source_slot, buffers)
            index, peer_slot = self.rank, expert_slot
        else:               # receives tokens from the sources, returns rows as sender `rank - S`
            self.inbox = Inbox(directory, self.rank, S, depth, expert_slot, buffers)
            index, peer_slot = self.rank - S, source_slot
        # gather_counts' inboxes: attention rank a's holds a slot per other attention rank (sender b at b - (b > a))
        self.count_round, self.count_inbox, self.count_outlets = 0, None, []
        inboxes = bool(count_words) and counts_by_inbox(S, dist.get_backend(group), ipc_events)
        others = [a for a in range(S) if a != self.rank] if self.is_source and inboxes else []
        if others:
            self.count_inbox = Inbox(directory, self.rank, S - 1, depth, count_words * 8, buffers,
                                     name=f"counts{self.rank}")
            self.count_pids, self.count_names = [int(every[a][0]) for a in others], [f"rank {a}" for a in others]
        exports = [None] * W      # CUDA IPC handles of the inboxes' payloads (None in host shared memory)
        dist.all_gather_object(exports, (self.inbox.export, self.count_inbox and self.count_inbox.export),
                               group=control)
        fence = _StoreFence()
        self.outlets = [Outlet(directory, p, fence, index, depth, peer_slot, buffers, exports[p][0]) for p in peers]
        self.count_outlets = [Outlet(directory, a, fence, self.rank - (self.rank > a), depth, count_words * 8, buffers,
                                     exports[a][1], name=f"counts{a}") for a in others]
        dist.barrier(group=control)
        if self.rank == 0:  # every rank has mapped and opened what it needs: leave nothing behind
            shutil.rmtree(directory)

    def abort(self) -> None:
        for outlet in self.outlets + self.count_outlets:
            outlet.abort()

    def interrupt(self) -> None:
        self.inbox.interrupt()
        if self.count_inbox is not None:
            self.count_inbox.interrupt()

    def gather_counts(self, out, mine, group):
        """As Dispatcher.gather_counts, through the counts inboxes when this dispatcher has them: this rank's counts
        to every other attention rank's inbox (one wait for the copies, then the round words), its own into out,
        then the others' from its inbox as they arrive (on a GPU: device copies, no host read)."""
        if self.count_inbox is None:
            return super().gather_counts(out, mine, group)
        self.count_round += 1
        rnd, E = self.count_round, mine.numel()
        self._send(rnd, [mine.view(torch.uint8).view(E, 8)] * len(self.count_outlets), self.count_outlets)
        out[self.rank * E:(self.rank + 1) * E].copy_(mine)
        slots = self.count_inbox.wait(rnd, self.timeout_s, f"rank {self.rank} expert counts", self.count_pids,
                                      self.count_names)
        for i, (_, slot) in enumerate(slots):
            a = i + (i >= self.rank)
            out[a * E:(a + 1) * E].copy_(slot[:E * 8].view(torch.int64))

    def _send(self, rnd: int, parts, outlets: list[Outlet] | None = None) -> None:
        """parts[i] `[n_i, bytes]` uint8 to outlets[i] (default: the dispatch and combine peers'), n_i posted as its
        count: every payload written, one wait for the copies (cuda_ipc: a stream synchronize for all of them), then
        every round word."""
        outlets = self.outlets if outlets is None else outlets
        for outlet, part in zip(outlets, parts):
            outlet.write(rnd, part.reshape(-1))
        self.buffers.publish()
        for outlet, part in zip(outlets, parts):
            outlet.post(rnd, part.shape[0])

    def set_capacity(self, capacity: int) -> None:
        if capacity > self.max_tokens:
            raise RuntimeError(f"rank {self.rank}: step capacity {capacity} exceeds the shm slots' "
                               f"{self.max_tokens} tokens")
        super().set_capacity(capacity)

    def start_dispatch(self, layer, hidden, dst_ranks, slots, weights):
        t0 = self.stats.now()
        W, S = self.world_size, self.num_sources
        self.round += 1
        if not self.is_source:   # an expert rank sends nothing in a dispatch: only its round moves on
            handle = DispatchHandle(layer, 0, self._no_rows, [0] * W, [0] * W, self.round)
            return PendingDispatch(None, self._no_rows, None, handle, t0)
        n = hidden.shape[0]
        if n > self.max_tokens:
            raise RuntimeError(f"rank {self.rank}: {n} tokens exceed the shm slots' {self.max_tokens}")
        if W - S == 1:
            # One expert rank: every token goes there, once, with all its choices: the rows are the tokens in
            # order, packed straight into the inbox slot (no plan, no gather, no packed copy).
            B = self._row_bytes()
            pack_rows_into(self.outlets[0].slot(self.round)[:n * B].view(n, B), hidden, slots, weights)
            self.buffers.publish()
            self.outlets[0].post(self.round, n)
            handle = DispatchHandle(layer, n, None, [0] * S + [n], [0] * W, self.round)
            self.stats.phase(layer, "dispatch").add(n * B, 1, self.stats.now() - t0)
            return PendingDispatch(None, self._no_rows, None, handle, t0)
        if self.in_band:
            # n places per expert rank, placed on the device, the empty ones slot -1: the host posts n, which it
            # knows (the blocks' count rows stay behind; combine gathers each token's results through hit/pos).
            E, B = W - S, self._row_bytes()
            blocks, hit, pos = place_rows(hidden.contiguous().view(torch.uint8), dst_ranks - S, slots, weights, E, n)
            self._send(self.round, blocks[:E * (n + 1)].view(E, n + 1, B)[:, 1:].unbind(0))
            handle = DispatchHandle(layer, n, None, [0] * S + [n] * E, [0] * W, self.round, hit, pos)
            self.stats.phase(layer, "dispatch").add(E * n * B, E, self.stats.now() - t0)
            return PendingDispatch(None, self._no_rows, None, handle, t0)
        row2token, row_dst, row_slots, row_weights = plan_rows(dst_ranks, slots, weights, W)
        send_counts = torch.bincount(row_dst, minlength=W).tolist()
        handle = DispatchHandle(layer, n, row2token, send_counts, [0] * W, self.round)
        packed = pack_rows(hidden[row2token], row_slots, row_weights)
        self._send(self.round, packed.split(send_counts[S:]))   # to expert ranks S..W-1
        self.stats.phase(layer, "dispatch").add(packed.numel(), len(self.outlets), self.stats.now() - t0)
        return PendingDispatch(None, self._no_rows, None, handle, t0)

    def finish_dispatch(self, pending):
        handle, B = pending.handle, self._row_bytes()
        if self.is_source:
            return unpack_rows(torch.empty(0, B, dtype=torch.uint8), self.hidden_size, self.top_k,
                               self.dtype), handle
        slots = self.inbox.wait(handle.round, self.timeout_s, f"rank {self.rank} dispatch (layer {handle.layer})",
                                self.peer_pids, self.peer_names)
        counts = [n for n, _ in slots]   # in-band counts: each source's batch size, its empty places slot -1
        valid = torch.cat([slot[:n * B].view(n, B) for n, slot in slots])
        handle.recv_counts = counts + [0] * (self.world_size - len(counts))
        self.stats.phase(handle.layer, "dispatch").add(0, 0, self.stats.now() - pending.t0)
        return unpack_rows(valid, self.hidden_size, self.top_k, self.dtype), handle

    def combine(self, expert_out, handle):
        t0 = self.stats.now()
        H, S = self.hidden_size, self.num_sources
        if not self.is_source:
            rows = expert_out.to(self.dtype).contiguous()
            self._send(handle.round, rows.view(torch.uint8).split(handle.recv_counts[:S]))   # to sources 0..S-1
            self.stats.phase(handle.layer, "combine").add(rows.numel() * rows.element_size(), S,
                                                          self.stats.now() - t0)
            return torch.zeros(handle.num_tokens, H, dtype=self.dtype, device=self.device)
        slots = self.inbox.wait(handle.round, self.timeout_s, f"rank {self.rank} combine (layer {handle.layer})",
                                self.peer_pids, self.peer_names)
        back = [slot[:n * H * self.dtype.itemsize].view(self.dtype).view(n, H) for n, slot in slots]
        if handle.hit is not None:      # in-band counts: a place per token from each expert rank, by where it went
            out = gather_rows(torch.stack(back), handle.hit, handle.pos)
        elif handle.row2token is None:  # one expert rank, one row per token in order: copied out of the slot
            out = back[0].clone()
        else:
            out = torch.zeros(handle.num_tokens, H, dtype=self.dtype, device=self.device)
            out.index_add_(0, handle.row2token, torch.cat(back))
        self.stats.phase(handle.layer, "combine").add(0, 0, self.stats.now() - t0)
        return out

