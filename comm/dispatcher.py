"""Dispatch (attention -> experts) and combine (experts -> attention) for one MoE layer.

Every rank calls both, in the same order, even with zero rows: attention ranks send tokens and
receive none; expert ranks send none and receive rows. A token crosses to an expert rank once,
however many of its top-k experts live there, carrying its K (slot, weight) pairs (slot -1 =
elsewhere). The expert rank returns one weighted-sum row per received row; the source adds
them up over ranks. Names: T tokens, H hidden, K top-k, W world size, N rows.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import p2p
from .blocks import gather_rows, place_rows
from .stats import CommStats


@dataclass(slots=True)
class ReceivedRows:
    """hidden `[N, H]`; slots `[N, K]` int64 local slot, -1 = not on this rank; weights `[N, K]` fp32."""

    hidden: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor


@dataclass(slots=True)
class DispatchHandle:
    """What combine needs to route results back: row2token `[N_sent]` int64 source token of each sent
    row; send_counts / recv_counts `[W]` python lists: valid rows sent to / received from each rank (with the
    shm transport's in-band counts each source's batch size, empty places included, and hit/pos `[T, E]` say
    where each token went, as comm/blocks.py place_rows gives them)."""

    layer: int
    num_tokens: int
    row2token: torch.Tensor | None    # None: the rows are the tokens in order (shm, one expert rank), or hit/pos
    send_counts: list[int]
    recv_counts: list[int]
    round: int = 0          # the call's sequence number (same on every rank); the shm transport keys slots by it
    hit: torch.Tensor | None = None
    pos: torch.Tensor | None = None


@dataclass(slots=True)
class PendingDispatch:
    """A dispatch in flight: the collective's work handle, the buffers it fills, and what combine needs."""

    work: object | None
    recv: torch.Tensor
    send: torch.Tensor | None
    handle: DispatchHandle
    t0: float


@dataclass(frozen=True, slots=True)
class Layout:
    """Stands in for a process group when a dispatcher is built only to plan (planned_messages, the cost
    model's predictions for a cluster this process is not part of): the world size and the rank it plans as."""

    world_size: int
    rank: int = 0


class Dispatcher(ABC):
    """Comm-mode interface. `set_capacity` once per step, then `dispatch` and `combine` once per MoE layer,
    on every rank. Ranks 0..num_sources-1 (the attention ranks) send tokens; the others hold experts.
    `group` is the data-plane process group, or a Layout for a dispatcher that only plans."""

    def __init__(self, group: dist.ProcessGroup | Layout, hidden_size: int, top_k: int, dtype: torch.dtype,
                 device: torch.device, num_sources: int, stats: CommStats | None = None,
                 ranks_per_node: int | None = None, nodes: list[int] | None = None):
        self.group = group
        if isinstance(group, Layout):
            self.world_size, self.rank = group.world_size, group.rank
        else:
            self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if nodes is not None:    # the node of each rank (a job re-formed after losing ranks keeps its nodes)
            if len(nodes) != self.world_size:
                raise ValueError(f"nodes names {len(nodes)} ranks' nodes for a world of {self.world_size}")
            self.node_of = list(nodes)
            self.ranks_per_node = max(self.node_of.count(n) for n in set(self.node_of))   # the fullest node's
        else:                    # nodes: consecutive blocks of ranks
            self.ranks_per_node = ranks_per_node or self.world_size
            self.node_of = [r // self.ranks_per_node for r in range(self.world_size)]
        self.my_node = self.node_of[self.rank]
        self.num_sources = num_sources
        self.hidden_size, self.top_k = hidden_size, top_k
        self.dtype, self.device = dtype, device
        self.stats = stats or CommStats()
        self.capacity = 0
        self._empty = None      # empty_tokens(), made on first use
        self._counts_via = p2p.ASK   # where gather_counts' tensors travel, decided on its first call

    @property
    def is_source(self) -> bool:
        return self.rank < self.num_sources

    def _row_bytes(self) -> int:
        """Bytes of one dispatched row: the hidden vector, then K int32 slots and K fp32 weights."""
        return self.hidden_size * self.dtype.itemsize + 8 * self.top_k

    def set_capacity(self, capacity: int) -> None:
        """No source dispatches more than `capacity` tokens until the next call (the step header's bound)."""
        self.capacity = capacity

    def abort(self) -> None:
        """This rank leaves the job's generation: wake peers blocked on it (collective transports need nothing
        here, aborting the process group does it)."""
        return None

    def interrupt(self) -> None:
        """From another thread: end this rank's own waits on its peers (the generation is being abandoned).
        Collective transports need nothing here: shutting down the generation's connections does it."""
        return None

    @abstractmethod
    def start_dispatch(self, layer: int, hidden: torch.Tensor, dst_ranks: torch.Tensor, slots: torch.Tensor,
                       weights: torch.Tensor) -> PendingDispatch:
        """Issue the dispatch without waiting for it. hidden `[T, H]`; dst_ranks `[T, K]` int64 world rank of
        each choice's replica; slots `[T, K]` int64 slot on that rank; weights `[T, K]` fp32."""

    @abstractmethod
    def finish_dispatch(self, pending: PendingDispatch) -> tuple[ReceivedRows, DispatchHandle]:
        """Wait for a started dispatch -> (rows this rank must compute, handle for combine)."""

    def dispatch(self, layer: int, hidden: torch.Tensor, dst_ranks: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor) -> tuple[ReceivedRows, DispatchHandle]:
        """Blocking dispatch: start_dispatch, then finish_dispatch."""
        return self.finish_dispatch(self.start_dispatch(layer, hidden, dst_ranks, slots, weights))

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_out `[N_received, H]` -> `[T, H]` summed over the ranks each token visited."""

    def gather_counts(self, out: torch.Tensor, mine: torch.Tensor, group) -> None:
        """Every attention rank's per-expert counts `mine` `[E]` int64 into `out` `[A * E]`, in rank order, without
        a host read where the transport allows: every attention rank calls it, in the same order as its dispatches,
        and expert ranks never do. Here one all_gather over `group` (the attention ranks on the data plane's
        backend: NCCL takes the GPU's tensors as they are, gloo takes host tensors); where it travels is decided
        on the first call (p2p.wire)."""
        if self._counts_via is p2p.ASK:
            self._counts_via = p2p.wire(mine, group)
        p2p.all_gather_into(out, mine, group, self._counts_via)

    def describe(self) -> dict:
        """Mode-specific facts for comm_stats (auto: its choices and cost model)."""
        return {}

    def flush(self) -> None:
        """Wait until every message this rank sent has been taken by its peer (two_phase leaves its sends
        pending across calls); call before this rank leaves the group, and it may leave safely. Modes that wait
        for their sends in the call that makes them have nothing to do."""
        return None

    def empty_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zero-token inputs for ranks with nothing to send (expert ranks, idle attention ranks); made once
        (they hold nothing, so every call may share them)."""
        if self._empty is None:
            K = self.top_k
            z = torch.empty(0, K, dtype=torch.int64, device=self.device)
            self._empty = (torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device), z, z,
                           torch.empty(0, K, dtype=torch.float32, device=self.device))
        return self._empty


def pack_rows(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One uint8 row per token: hidden bytes, then K int32 slots, then K fp32 weights -> one message per peer."""
    return torch.cat([hidden.contiguous().view(torch.uint8), slots.to(torch.int32).view(torch.uint8),
                      weights.to(torch.float32).view(torch.uint8)], dim=1)


def pack_rows_into(rows: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> None:
    """`pack_rows` written into rows `[T, bytes]` uint8 (e.g. a peer's inbox slot), a column band at a time: no
    packed copy in between."""
    hb, K = hidden.shape[1] * hidden.element_size(), slots.shape[1]
    rows[:, :hb].view(hidden.dtype).copy_(hidden)
    rows[:, hb:hb + 4 * K].view(torch.int32).copy_(slots)
    rows[:, hb + 4 * K:].view(torch.float32).copy_(weights)


def unpack_rows(buf: torch.Tensor, hidden_size: int, top_k: int, dtype: torch.dtype) -> ReceivedRows:
    hb = hidden_size * dtype.itemsize
    hidden = buf[:, :hb].contiguous().view(dtype)
    slots = buf[:, hb:hb + 4 * top_k].contiguous().view(torch.int32).to(torch.int64)
    weights = buf[:, hb + 4 * top_k:].contiguous().view(torch.float32)
    return ReceivedRows(hidden, slots, weights)


def plan_rows(dst_ranks: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, world_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deduplicate (token, destination) pairs, sorted by destination then token.

    Returns row2token `[N]`, row_dst `[N]`, row_slots `[N, K]` (-1 where the choice is on another
    rank), row_weights `[N, K]`. Vectorised: no loop over tokens.
    """
    T, K = dst_ranks.shape
    tok = torch.arange(T, device=dst_ranks.device)[:, None].expand(T, K)
    keys = (dst_ranks * T + tok).flatten()
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    row_slots = torch.full((uniq.numel(), K), -1, dtype=torch.int64, device=dst_ranks.device)
    row_weights = torch.zeros(uniq.numel(), K, dtype=torch.float32, device=dst_ranks.device)
    kk = torch.arange(K, device=dst_ranks.device).expand(T, K).flatten()
    row_slots[inverse, kk] = slots.flatten()
    row_weights[inverse, kk] = weights.flatten().float()
    return uniq % max(T, 1), uniq // max(T, 1), row_slots, row_weights


@dataclass(slots=True)
class DirectHandle:
    """What the direct combine needs, all device tensors of fixed shape (no host reads): hit `[T, E]` whether
    token t visits expert rank e, pos `[T, E]` its row in that rank's block; on an expert rank, valid `[S * C]`
    whether each received row holds a token."""

    layer: int
    num_tokens: int
    capacity: int
    hit: torch.Tensor | None = None
    pos: torch.Tensor | None = None


class DirectDispatcher(Dispatcher):
    """One message per (attention rank, expert rank) pair and direction, every shape fixed by the step header.

    Dispatch: each source sends every expert rank a block of capacity + 1 rows; row 0 carries the number of valid
    rows in-band (capacity is the step header's bound, known to all on the host, so no split needs exchanging).
    Where each token goes is worked out on the device with fixed shapes (a `[T, E]` visit map and a cumulative
    sum for row positions; a token bound for no rank lands in a scratch row that is never sent), so nothing is
    read back to the host and nothing has a data-dependent shape. Combine: the expert rank returns its
    capacity rows per source (rows past the count are zeros) and the source gathers each token's rows from the
    positions it sent them to. With a single source the two hops are a scatter and a gather (on gloo about half
    the latency of an all_to_all); otherwise all_to_all_single calls whose splits follow from the roles alone.
    """

    def start_dispatch(self, layer, hidden, dst_ranks, slots, weights):
        # T tokens, E expert ranks, W world, S sources, C capacity, B bytes per row, K top-k
        t0 = self.stats.now()
        W, S, C, B = self.world_size, self.num_sources, self.capacity, self._row_bytes()
        E, T = W - S, hidden.shape[0]
        if T > C:
            raise RuntimeError(f"rank {self.rank}: {T} tokens exceed the step capacity {C}")
        handle = DirectHandle(layer, T, C)
        blocks = None
        if self.is_source:
            blocks, handle.hit, handle.pos = self._pack_blocks(hidden, dst_ranks - S, slots, weights)
        if S == 1:  # scatter from the single source (its own block is unused)
            recv = torch.empty(C + 1, B, dtype=torch.uint8, device=self.device)
            chunks = [blocks.new_empty(C + 1, B)] + [blocks[e * (C + 1):(e + 1) * (C + 1)] for e in range(E)] \
                if self.is_source else None
            work = dist.scatter(recv, chunks, src=0, group=self.group, async_op=True)
            recv = recv[:0].view(0, C + 1, B) if self.is_source else recv[None]
        else:
            send = blocks[:E * (C + 1)] if self.is_source else torch.empty(0, B, dtype=torch.uint8, device=self.device)
            recv = torch.empty(0 if self.is_source else S, C + 1, B, dtype=torch.uint8, device=self.device)
            out_splits = [0] * S + [C + 1] * E if self.is_source else [0] * W
            in_splits = [0] * W if self.is_source else [C + 1] * S + [0] * E
            work = dist.all_to_all_single(recv.view(-1, B), send, in_splits, out_splits, group=self.group,
                                          async_op=True)
        return PendingDispatch(work, recv, blocks, handle, t0)

    def _pack_blocks(self, hidden, dst, slots, weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden `[T, H]`, dst `[T, K]` expert-rank index (0..E-1) -> (blocks `[E * (C + 1) + 1, B]` uint8: per
        expert rank a count row (int64) and C row places, then the scratch row; hit `[T, E]`; pos `[T, E]`)."""
        E = self.world_size - self.num_sources
        return place_rows(hidden.contiguous().view(torch.uint8), dst, slots, weights, E, self.capacity)

    def finish_dispatch(self, pending):
        W, S, C, B = self.world_size, self.num_sources, self.capacity, self._row_bytes()
        pending.work.wait()
        recv, handle = pending.recv, pending.handle
        # Every received row place, in source order; places past a source's count carry slot -1 (computed by
        # no expert) and zeros.
        counts = recv[:, 0, :8].contiguous().view(torch.int64).view(-1)               # [S] (0 on sources)
        rows = unpack_rows(recv[:, 1:].reshape(-1, B), self.hidden_size, self.top_k, self.dtype)
        valid = (torch.arange(C, device=self.device)[None, :] < counts[:, None]).reshape(-1, 1)
        rows.slots = torch.where(valid, rows.slots, -1)
        st = self.stats.phase(handle.layer, "dispatch")
        for peer in (range(S, W) if self.is_source else ()):
            st.add_message((C + 1) * B, self.node_of[peer] != self.my_node)
        st.add(0, 0, self.stats.now() - pending.t0)
        return rows, handle

    def planned_messages(self, capacity: int) -> list[list[tuple[int, int, int]]]:
        """The (src, dst, bytes) messages of one layer at this capacity, per hop: dispatch, then combine."""
        W, S, C = self.world_size, self.num_sources, capacity
        hb = self.hidden_size * self.dtype.itemsize
        return [[(s, e, (C + 1) * self._row_bytes()) for s in range(S) for e in range(S, W)],
                [(e, s, C * hb) for e in range(S, W) for s in range(S)]]

    def combine(self, expert_out, handle):
        t0 = self.stats.now()
        W, S, C, H = self.world_size, self.num_sources, handle.capacity, self.hidden_size
        E = W - S
        if self.is_source:
            back = torch.empty(E * C, H, dtype=self.dtype, device=self.device)
            if S == 1:  # gather to the single source: [own (unused), expert ranks...]
                parts = [torch.empty(C, H, dtype=self.dtype, device=self.device)] + list(back.view(E, C, H))
                dist.gather(torch.empty(C, H, dtype=self.dtype, device=self.device), parts, dst=0,
                            group=self.group)
            else:
                dist.all_to_all_single(back, torch.empty(0, H, dtype=self.dtype, device=self.device),
                                       [0] * S + [C] * E, [0] * W, group=self.group)
            sent = []
            # token t's share from expert rank e sits at row e * C + pos[t, e] (where it visited e)
            out = gather_rows(back.view(E, C, H), handle.hit, handle.pos)
        else:
            block = expert_out.to(self.dtype).contiguous()                              # [S * C, H]
            if S == 1:
                dist.gather(block, None, dst=0, group=self.group)
            else:
                dist.all_to_all_single(torch.empty(0, H, dtype=self.dtype, device=self.device), block,
                                       [0] * W, [C] * S + [0] * E, group=self.group)
            sent = [(s, C * H * self.dtype.itemsize) for s in range(S)]
            out = torch.zeros(handle.num_tokens, H, dtype=self.dtype, device=self.device)
        st = self.stats.phase(handle.layer, "combine")
        for peer, nbytes in sent:
            st.add_message(nbytes, self.node_of[peer] != self.my_node)
        st.add(0, 0, self.stats.now() - t0)
        return out

