"""two_phase: aggregate inside a node, cross nodes once per node pair, fan out inside the destination node.

Dispatch, for every destination node nd that holds expert ranks:
  1. each source rank sends its tokens that have any choice on nd (once per token, deduplicated) to the
     gateway of (its node, nd) on its own node;
  2. that gateway sends everything its node has for nd in one message to its peer gateway on nd, the rank
     with the same local index;
  3. the peer gateway splits each row per expert rank of nd it names (once per (row, rank)) and sends each
     expert rank its rows.
Combine runs the same path backwards: expert ranks return one weighted-sum row per row; the nd gateway
adds up the rows of each token over nd's expert ranks and returns one row per token to the source node's
gateway, which hands each source its rows; the source adds them up over nodes.

Gateways are chosen by local index: (ns, nd) uses local index (ns + nd) mod min(|ns|, |nd|) on both nodes, so
nodes of different sizes work and different node pairs spread over different ranks. Per layer and direction
the inter-node messages are one per (source node, destination node) pair with tokens, instead of one per
(source rank, expert rank) pair.

Every message is point-to-point (isend/irecv over the data-plane group): a block of bound + 1 rows whose
first row holds the row count, where the bound (the step capacity times the sources whose tokens the
message can carry) is known to both sides, so there is no size exchange, as in `direct`. Choices cross
nodes as a code (rank << 20 | slot). Names: T tokens, H hidden, K top-k, W world size, S sources.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .cost_model import CostModel
from .dispatcher import DirectDispatcher, Dispatcher, PendingDispatch, pack_rows, plan_rows, unpack_rows

SLOT_BITS = 20
MAX_RANKS = 1 << (31 - SLOT_BITS)   # a code must fit an int32


@dataclass(slots=True)
class TwoPhaseHandle:
    """What combine needs to walk the path back (all lists in the order the dispatch used)."""

    layer: int
    num_tokens: int
    to_gateway: dict[int, torch.Tensor] = field(default_factory=dict)      # source: nd -> token of each row sent
    from_sources: dict[int, list[int]] = field(default_factory=dict)       # gateway: nd -> rows from each source
    from_gateways: list[int] = field(default_factory=list)                 # nd gateway: rows from each ns gateway
    exploded: torch.Tensor | None = None                                   # nd gateway: merged row of each row sent
    from_nd_gateways: list[int] = field(default_factory=list)              # expert: rows from each nd gateway


class TwoPhaseDispatcher(Dispatcher):
    def __init__(self, group, hidden_size, top_k, dtype, device, num_sources, stats=None, ranks_per_node=None):
        super().__init__(group, hidden_size, top_k, dtype, device, num_sources, stats, ranks_per_node)
        W, S = self.world_size, num_sources
        if W > MAX_RANKS:
            raise ValueError(f"two_phase addresses at most {MAX_RANKS} ranks; this job has {W}")
        self.members: dict[int, list[int]] = {}
        for r in range(W):
            self.members.setdefault(self.node_of[r], []).append(r)
        self.src_nodes = sorted({self.node_of[r] for r in range(S)})
        self.dst_nodes = sorted({self.node_of[r] for r in range(S, W)})
        # What this rank does on every call, fixed by the topology:
        me, here = self.rank, self.my_node
        self.node_sources = self._sources_on(here)
        self.node_experts = self._experts_on(here)
        self.gateway_for = [nd for nd in self.dst_nodes            # source-node gateway for these nd
                            if here in self.src_nodes and self.gateways(here, nd)[0] == me]
        self.gateway_of = [ns for ns in self.src_nodes             # nd gateway for these source nodes
                           if here in self.dst_nodes and self.gateways(ns, here)[1] == me]
        self.nd_gateways = [] if self.is_source or here not in self.dst_nodes else \
            sorted({self.gateways(ns, here)[1] for ns in self.src_nodes})          # an expert rank hears from these
        self.num_sources_on = {n: len(self._sources_on(n)) for n in self.members}
        self.served_sources = {}                                    # nd gateway -> sources whose tokens it takes
        for ns in self.src_nodes:
            for nd in self.dst_nodes:
                g2 = self.gateways(ns, nd)[1]
                self.served_sources[g2] = self.served_sources.get(g2, 0) + self.num_sources_on[ns]

    def gateways(self, ns: int, nd: int) -> tuple[int, int]:
        """(gateway on ns, gateway on nd) for traffic from source node ns to destination node nd."""
        a, b = self.members[ns], self.members[nd]
        i = (ns + nd) % min(len(a), len(b))
        return a[i], b[i]

    def _sources_on(self, node: int) -> list[int]:
        return [r for r in self.members[node] if r < self.num_sources]

    def _experts_on(self, node: int) -> list[int]:
        return [r for r in self.members[node] if r >= self.num_sources]

    # ----- messages ----------------------------------------------------------------------------------------
    def _block(self, bound: int, width: int, n: int) -> torch.Tensor:
        """An outgoing message: `[bound + 1, width]` uint8 whose row 0 holds the count n; rows 1..n to be filled."""
        assert n <= bound, (n, bound)
        block = torch.empty(bound + 1, width, dtype=torch.uint8, device=self.device)
        block[0, :8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
        return block

    def _exchange(self, sends: list[tuple[int, int, torch.Tensor, int | None]], recvs: list[tuple[int, int, int]],
                  width: int, layer: int, phase: str) -> list[torch.Tensor]:
        """Point-to-point rows. sends: (peer, tag, `[n, width]` uint8 rows, bound), or (peer, tag, block, None)
        for a block made by `_block` and filled already; recvs: (peer, tag, bound) -> the rows of each recv, in
        order. Each message is a block of bound + 1 rows (row 0: the count), a size both sides know; a message
        to oneself is a reference, not a message."""
        me, stats = self.rank, self.stats.phase(layer, phase)
        local, ops, blocks = {}, [], []
        for peer, tag, rows, bound in sends:
            if bound is None:
                block, rows = rows, rows[1:1 + int(rows[0, :8].view(torch.int64))]
            elif peer != me:
                block = self._block(bound, width, rows.shape[0])
                block[1:1 + rows.shape[0]] = rows
            if peer == me:
                local[tag] = rows
                continue
            ops.append(dist.P2POp(dist.isend, block, peer, self.group, tag))
            stats.add_message(block.numel(), self.node_of[peer] != self.my_node)
        for peer, tag, bound in recvs:
            buf = None
            if peer != me:
                buf = torch.empty(bound + 1, width, dtype=torch.uint8, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer, self.group, tag))
            blocks.append(buf)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return [local[tag] if buf is None else buf[1:1 + int(buf[0, :8].view(torch.int64))]
                for (_, tag, _), buf in zip(recvs, blocks)]

    def _bound(self, ns: int, capacity: int) -> int:
        """Most rows a source node can have for one destination node: one per token of each of its sources."""
        return self.num_sources_on[ns] * capacity

    def _nd_bound(self, gateway: int, capacity: int) -> int:
        """Most rows an nd gateway can hold: one per token of each source whose node it serves."""
        return self.served_sources[gateway] * capacity

    def planned_messages(self, capacity: int) -> list[list[tuple[int, int, int]]]:
        """The (src, dst, bytes) messages of one layer at this capacity, per hop: 3 dispatch, 3 combine."""
        B, hb = self._row_bytes(), self.hidden_size * self.dtype.itemsize
        hops: list[list[tuple[int, int, int]]] = [[] for _ in range(6)]
        for ns in self.src_nodes:
            for nd in self.dst_nodes:
                g1, g2 = self.gateways(ns, nd)
                for s in self._sources_on(ns):
                    if s != g1:
                        hops[0].append((s, g1, (capacity + 1) * B))
                        hops[5].append((g1, s, (capacity + 1) * hb))
                if g1 != g2:
                    hops[1].append((g1, g2, (self._bound(ns, capacity) + 1) * B))
                    hops[4].append((g2, g1, (self._bound(ns, capacity) + 1) * hb))
        for nd in self.dst_nodes:
            for g2 in sorted({self.gateways(ns, nd)[1] for ns in self.src_nodes}):
                for r in self._experts_on(nd):
                    if r != g2:
                        hops[2].append((g2, r, (self._nd_bound(g2, capacity) + 1) * B))
                        hops[3].append((r, g2, (self._nd_bound(g2, capacity) + 1) * hb))
        return hops

    @staticmethod
    def _tag(hop: int, key: int) -> int:
        """Hops 1-3 dispatch, 4-6 combine; key a node (< 4096)."""
        return hop * 4096 + key

    # ----- dispatch ----------------------------------------------------------------------------------------
    def start_dispatch(self, layer, hidden, dst_ranks, slots, weights):
        t0 = time.perf_counter()
        W, me, B, C = self.world_size, self.rank, self._row_bytes(), self.capacity
        if hidden.shape[0] > self.capacity:
            raise RuntimeError(f"rank {me}: {hidden.shape[0]} tokens exceed the step capacity {self.capacity}")
        handle = TwoPhaseHandle(layer, hidden.shape[0])
        # hop 1: my tokens, once per destination node, to my node's gateway for it
        sends = []
        if self.is_source:
            code = torch.where(slots >= 0, (dst_ranks << SLOT_BITS) | slots, -1)
            row2token, row_node, row_code, row_w = plan_rows(dst_ranks // self.ranks_per_node, code, weights, W)
            for nd in self.dst_nodes:
                sel = row_node == nd
                handle.to_gateway[nd] = row2token[sel]
                sends.append((self.gateways(self.my_node, nd)[0], self._tag(1, nd),
                              pack_rows(hidden[row2token[sel]], row_code[sel], row_w[sel]), C))
        srcs = self.node_sources
        got = self._exchange(sends, [(s, self._tag(1, nd), C) for nd in self.gateway_for for s in srcs], B, layer,
                             "dispatch")
        # hop 2: what my node has for nd, in one message to nd's gateway
        sends = []
        for i, nd in enumerate(self.gateway_for):
            part = got[i * len(srcs):(i + 1) * len(srcs)]
            handle.from_sources[nd] = [p.shape[0] for p in part]
            sends.append((self.gateways(self.my_node, nd)[1], self._tag(2, self.my_node), torch.cat(part),
                          self._bound(self.my_node, C)))
        got = self._exchange(sends, [(self.gateways(ns, self.my_node)[0], self._tag(2, ns), self._bound(ns, C))
                                     for ns in self.gateway_of], B, layer, "dispatch")
        # hop 3: each expert rank of this node gets the rows naming it, copied once into its message, with
        # the other ranks' choices blanked (slot -1, weight 0)
        sends = []
        if self.gateway_of:
            handle.from_gateways = [g.shape[0] for g in got]
            merged = torch.cat(got)
            hb, K = self.hidden_size * self.dtype.itemsize, self.top_k
            codes = merged[:, hb:hb + 4 * K].contiguous().view(torch.int32)
            weights_ = merged[:, hb + 4 * K:].contiguous().view(torch.float32)
            rank = torch.where(codes >= 0, codes >> SLOT_BITS, W)
            slot = codes & ((1 << SLOT_BITS) - 1)
            exploded = []
            for r in self.node_experts:
                mine = rank == r
                rows = mine.any(dim=1).nonzero().flatten()
                exploded.append(rows)
                block = self._block(self._nd_bound(me, C), B, rows.numel())
                body = block[1:1 + rows.numel()]
                torch.index_select(merged, 0, rows, out=body)
                mine = mine[rows]
                body[:, hb:hb + 4 * K] = torch.where(mine, slot[rows], -1).view(torch.uint8)
                body[:, hb + 4 * K:] = torch.where(mine, weights_[rows], 0.0).view(torch.uint8)
                sends.append((r, self._tag(3, 0), block, None))
            handle.exploded = torch.cat(exploded) if exploded else torch.empty(0, dtype=torch.int64)
        got = self._exchange(sends, [(g, self._tag(3, 0), self._nd_bound(g, C)) for g in self.nd_gateways], B, layer,
                             "dispatch")
        handle.from_nd_gateways = [g.shape[0] for g in got]
        rows = torch.cat(got) if got else torch.empty(0, B, dtype=torch.uint8, device=self.device)
        self.stats.phase(layer, "dispatch").add(0, 0, time.perf_counter() - t0)
        return PendingDispatch(None, rows, None, handle, t0)

    def finish_dispatch(self, pending):
        return unpack_rows(pending.recv, self.hidden_size, self.top_k, self.dtype), pending.handle

    # ----- combine -----------------------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: TwoPhaseHandle) -> torch.Tensor:
        t0 = time.perf_counter()
        H, me, layer, C = self.hidden_size, self.rank, handle.layer, self.capacity
        width = H * self.dtype.itemsize

        def as_bytes(x: torch.Tensor) -> torch.Tensor:
            return x.to(self.dtype).contiguous().view(torch.uint8).view(-1, width)

        def as_hidden(x: torch.Tensor) -> torch.Tensor:
            return x.contiguous().view(self.dtype).view(-1, H)

        # hop 3 back: each expert rank returns its rows to the nd gateways they came from
        out_rows = as_bytes(expert_out)
        sends, start = [], 0
        for g, n in zip(self.nd_gateways, handle.from_nd_gateways):
            sends.append((g, self._tag(6, 0), out_rows[start:start + n], self._nd_bound(g, C)))
            start += n
        experts = self.node_experts if handle.exploded is not None else []
        got = self._exchange(sends, [(r, self._tag(6, 0), self._nd_bound(me, C)) for r in experts], width, layer,
                             "combine")
        # hop 2 back: sum each merged row over this node's experts, return each ns gateway its rows
        sends = []
        if handle.exploded is not None:
            acc = torch.zeros(sum(handle.from_gateways), H, dtype=self.dtype, device=self.device)
            start = 0
            for rows in got:                      # in node_experts order, as handle.exploded
                if rows.shape[0]:
                    acc.index_add_(0, handle.exploded[start:start + rows.shape[0]], as_hidden(rows))
                start += rows.shape[0]
            acc, start = as_bytes(acc), 0
            for ns, n in zip(self.gateway_of, handle.from_gateways):
                sends.append((self.gateways(ns, self.my_node)[0], self._tag(5, ns), acc[start:start + n],
                              self._bound(ns, C)))
                start += n
        got = self._exchange(sends, [(self.gateways(self.my_node, nd)[1], self._tag(5, self.my_node),
                                      self._bound(self.my_node, C)) for nd in self.gateway_for], width, layer,
                             "combine")
        # hop 1 back: hand each source its rows
        sends = []
        for nd, rows in zip(self.gateway_for, got):
            start = 0
            for s, n in zip(self.node_sources, handle.from_sources[nd]):
                sends.append((s, self._tag(4, nd), rows[start:start + n], C))
                start += n
        back = list(handle.to_gateway)
        got = self._exchange(sends, [(self.gateways(self.my_node, nd)[0], self._tag(4, nd), C) for nd in back],
                             width, layer, "combine")
        out = torch.zeros(handle.num_tokens, H, dtype=self.dtype, device=self.device)
        for nd, rows in zip(back, got):
            if rows.shape[0]:
                out.index_add_(0, handle.to_gateway[nd], as_hidden(rows))
        self.stats.phase(layer, "combine").add(0, 0, time.perf_counter() - t0)
        return out



class AutoDispatcher(Dispatcher):
    """Per call, `direct` or `two_phase`, whichever the cost model predicts faster for the step's capacity and
    this topology (every rank holds the same model and capacity, so every rank makes the same choice)."""

    def __init__(self, group, hidden_size, top_k, dtype, device, num_sources, stats=None, ranks_per_node=None, *,
                 model: CostModel):
        super().__init__(group, hidden_size, top_k, dtype, device, num_sources, stats, ranks_per_node)
        args = (group, hidden_size, top_k, dtype, device, num_sources, self.stats, ranks_per_node)
        self.modes: dict[str, Dispatcher] = {"direct": DirectDispatcher(*args), "two_phase": TwoPhaseDispatcher(*args)}
        self.model = model
        self.choice = "direct"
        self.calls = {name: 0 for name in self.modes}
        self._choices: dict[int, str] = {}

    def predict(self, capacity: int) -> dict[str, float]:
        """Predicted seconds of one layer (dispatch + combine) per mode."""
        return {name: self.model.layer_time(d.planned_messages(capacity), self.node_of)
                for name, d in self.modes.items()}

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        for d in self.modes.values():
            d.set_capacity(capacity)
        if capacity not in self._choices:
            t = self.predict(capacity)
            self._choices[capacity] = min(t, key=lambda name: (t[name], name))
        self.choice = self._choices[capacity]

    def start_dispatch(self, layer, hidden, dst_ranks, slots, weights):
        self.calls[self.choice] += 1
        return self.modes[self.choice].start_dispatch(layer, hidden, dst_ranks, slots, weights)

    def _mode_of(self, handle) -> Dispatcher:
        return self.modes["two_phase" if isinstance(handle, TwoPhaseHandle) else "direct"]

    def finish_dispatch(self, pending):
        return self._mode_of(pending.handle).finish_dispatch(pending)

    def combine(self, expert_out, handle):
        return self._mode_of(handle).combine(expert_out, handle)

    def describe(self) -> dict:
        return {"calls": dict(self.calls), "cost_model": self.model.to_dict()}
