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

A hop waits only for what it receives, never for its sends: a gloo send completes only once the peer has posted
the matching receive, and the peer may be busy (an expert rank computing the other micro-batch), so waiting
there would hold the sender. A dispatch's sends are waited at the start of its combine, a combine's at the start
of the next dispatch, by which time the peers have taken them in the blocking version's order. So a source that
is not a gateway returns from start_dispatch as soon as its hop-1 messages are posted, and a source-node gateway
once it has its node's rows and has posted hop 2: the ping-pong micro-batches overlap the expert ranks' work.
NCCL's batched ops come back as one coalesced work, which only orders streams: it is waited at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .blocks import compact, count_of, expand, gather_rows, place_rows, set_count, valid_places
from .cost_model import CostModel
from .dispatcher import DirectDispatcher, Dispatcher, PendingDispatch, unpack_rows

SLOT_BITS = 20
MAX_RANKS = 1 << (31 - SLOT_BITS)   # a code must fit an int32


@dataclass(slots=True)
class TwoPhaseHandle:
    """What combine needs to walk the path back, all device tensors of fixed shape (no host reads). D destination
    nodes, S_n sources on my node, M_n expert ranks on my node, R rows an nd gateway holds."""

    layer: int
    num_tokens: int
    hit: torch.Tensor | None = None        # source: [T, D] whether token t has a choice on dst_nodes[d]
    pos: torch.Tensor | None = None        # source: [T, D] its place in the block for that node
    where: dict[int, torch.Tensor] = field(default_factory=dict)   # ns gateway: nd -> [S_n, C] place of each
    #                                        source's row place in the hop-2 block (bound + 1 = empty)
    from_sources: dict[int, torch.Tensor] = field(default_factory=dict)   # ns gateway: nd -> [S_n] rows per source
    from_gateways: torch.Tensor | None = None   # nd gateway: [len(gateway_of)] rows from each ns gateway
    fan_hit: torch.Tensor | None = None    # nd gateway: [R, M_n] whether row n goes to node_experts[m]
    fan_pos: torch.Tensor | None = None    # nd gateway: [R, M_n] its place in that rank's block
    from_nd_gateways: torch.Tensor | None = None  # expert: [len(nd_gateways)] rows from each nd gateway
    valid: torch.Tensor | None = None      # expert: [sum of nd_bound(g)] whether each received row place holds a row
    sends: list = field(default_factory=list)   # the dispatch's send works not yet waited (and their blocks)


class TwoPhaseDispatcher(Dispatcher):
    def __init__(self, group, hidden_size, top_k, dtype, device, num_sources, stats=None, ranks_per_node=None,
                 nodes=None):
        super().__init__(group, hidden_size, top_k, dtype, device, num_sources, stats, ranks_per_node, nodes)
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
        # node -> index in dst_nodes (-1: holds no expert ranks), to address a choice's node block
        self.node_index = torch.full((max(self.node_of) + 1,), -1, dtype=torch.int64, device=device)
        self.node_index[self.dst_nodes] = torch.arange(len(self.dst_nodes), device=device)
        self.rank_node_index = self.node_index[torch.tensor(self.node_of, device=device)]   # rank -> the same
        # rank -> its place in node_experts (-1: not an expert rank of this node). A re-formed job's node may hold
        # ranks that are not consecutive (a joiner is numbered last but fills the lowest node with room)
        self.fan_index = torch.full((W,), -1, dtype=torch.int64, device=device)
        self.fan_index[self.node_experts] = torch.arange(len(self.node_experts), device=device)
        self._combine_sends: list = []     # the last combine's send works, waited at the next dispatch

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
    def _exchange(self, sends: list[tuple[int, int, torch.Tensor]], recvs: list[tuple[int, int, int]], width: int,
                  layer: int, phase: str, pending: list) -> list[torch.Tensor]:
        """Point-to-point blocks. sends: (peer, tag, `[bound + 1, width]` uint8 block); recvs: (peer, tag, bound)
        -> the received blocks, in order, whole (row 0: the count; nobody reads it on the host). A message to
        oneself is a reference, not a message. Waits for the receives only; the sends' works (with their blocks)
        go to `pending`, for the caller to wait later (`_wait`)."""
        me, stats = self.rank, self.stats.phase(layer, phase)
        local, ops, blocks = {}, [], []
        for peer, tag, block in sends:
            if peer == me:
                local[tag] = block
                continue
            ops.append(dist.P2POp(dist.isend, block, peer, self.group, tag))
            stats.add_message(block.numel(), self.node_of[peer] != self.my_node)
        num_sends = len(ops)
        for peer, tag, bound in recvs:
            buf = None
            if peer != me:
                buf = torch.empty(bound + 1, width, dtype=torch.uint8, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer, self.group, tag))
            blocks.append(buf)
        if ops:
            works = dist.batch_isend_irecv(ops)
            if len(works) == len(ops):      # one work per op (gloo): the sends may finish later
                pending += [(work, op.tensor) for work, op in zip(works[:num_sends], ops)]
                works = works[num_sends:]
            for work in works:
                work.wait()
        return [local[tag] if buf is None else buf for (_, tag, _), buf in zip(recvs, blocks)]

    def flush(self) -> None:
        self._wait(self._combine_sends)

    @staticmethod
    def _wait(pending: list) -> None:
        """Wait for send works `_exchange` left pending (each peer has posted its receive by then)."""
        for work, _ in pending:
            work.wait()
        pending.clear()

    def _reply(self, rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """A combine message: rows `[bound, width]` uint8 under a count row -> `[bound + 1, width]`."""
        return set_count(torch.cat([rows.new_zeros(1, rows.shape[1]), rows]), count)

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
        # T tokens, D destination nodes, C capacity, B bytes per row, K top-k; every shape follows from C and
        # the topology, every place from a visit map and a cumulative sum on the device
        t0 = self.stats.now()
        me, here, B, C, K = self.rank, self.my_node, self._row_bytes(), self.capacity, self.top_k
        hb = self.hidden_size * self.dtype.itemsize
        if hidden.shape[0] > C:
            raise RuntimeError(f"rank {me}: {hidden.shape[0]} tokens exceed the step capacity {C}")
        self._wait(self._combine_sends)
        handle = TwoPhaseHandle(layer, hidden.shape[0])
        # Step 1: my tokens, once per destination node, to my node's gateway for it (a block per node; a
        # choice crosses as a code, rank << SLOT_BITS | slot, -1 on the other nodes' blocks)
        sends = []
        if self.is_source:
            code = torch.where(slots >= 0, (dst_ranks << SLOT_BITS) | slots, -1)
            blocks, handle.hit, handle.pos = place_rows(hidden.contiguous().view(torch.uint8),
                                                        self.rank_node_index[dst_ranks], code,
                                                        weights, len(self.dst_nodes), C)
            sends = [(self.gateways(here, nd)[0], self._tag(1, nd), blocks[i * (C + 1):(i + 1) * (C + 1)])
                     for i, nd in enumerate(self.dst_nodes)]
        srcs = self.node_sources
        got = self._exchange(sends, [(s, self._tag(1, nd), C) for nd in self.gateway_for for s in srcs], B, layer,
                             "dispatch", handle.sends)
        # Step 2: what my node has for nd, packed into one block, to nd's gateway
        sends = []
        for i, nd in enumerate(self.gateway_for):
            part = torch.stack(got[i * len(srcs):(i + 1) * len(srcs)])                    # [S_n, C + 1, B]
            handle.from_sources[nd] = count_of(part)
            block, handle.where[nd] = compact(part, self._bound(here, C))
            sends.append((self.gateways(here, nd)[1], self._tag(2, here), block))
        bounds = [self._bound(ns, C) for ns in self.gateway_of]
        got = self._exchange(sends, [(self.gateways(ns, here)[0], self._tag(2, ns), n)
                                     for ns, n in zip(self.gateway_of, bounds)], B, layer, "dispatch", handle.sends)
        # Step 3: each row to every expert rank of this node it names, the other ranks' choices blanked
        sends = []
        if self.gateway_of:
            handle.from_gateways = torch.stack([count_of(g) for g in got])
            valid = torch.cat([valid_places(c[None], n)[0] for c, n in zip(handle.from_gateways, bounds)])
            merged = torch.cat([g[1:] for g in got])                                      # [R, B]
            codes = merged[:, hb:hb + 4 * K].contiguous().view(torch.int32).to(torch.int64)
            named = torch.where(codes >= 0, codes >> SLOT_BITS, 0)
            rank = torch.where(valid[:, None] & (codes >= 0), self.fan_index[named], -1)
            fan, n = len(self.node_experts), self._nd_bound(me, C)
            blocks, handle.fan_hit, handle.fan_pos = place_rows(
                merged[:, :hb], rank, codes & ((1 << SLOT_BITS) - 1),
                merged[:, hb + 4 * K:].contiguous().view(torch.float32), fan, n)
            sends = [(r, self._tag(3, 0), blocks[j * (n + 1):(j + 1) * (n + 1)])
                     for j, r in enumerate(self.node_experts)]
        bounds = [self._nd_bound(g, C) for g in self.nd_gateways]
        got = self._exchange(sends, [(g, self._tag(3, 0), n) for g, n in zip(self.nd_gateways, bounds)], B, layer,
                             "dispatch", handle.sends)
        rows = torch.empty(0, B, dtype=torch.uint8, device=self.device)
        handle.valid = torch.zeros(0, dtype=torch.bool, device=self.device)
        if got:
            handle.from_nd_gateways = torch.stack([count_of(g) for g in got])
            handle.valid = torch.cat([valid_places(c[None], n)[0] for c, n in zip(handle.from_nd_gateways, bounds)])
            rows = torch.cat([g[1:] for g in got])
        self.stats.phase(layer, "dispatch").add(0, 0, self.stats.now() - t0)
        return PendingDispatch(None, rows, None, handle, t0)

    def finish_dispatch(self, pending):
        # every received row place, in nd gateway order; places past a gateway's count get slot -1 (computed by
        # no expert) and weight 0
        rows, valid = unpack_rows(pending.recv, self.hidden_size, self.top_k, self.dtype), pending.handle.valid
        rows.slots = torch.where(valid[:, None], rows.slots, -1)
        rows.weights = torch.where(valid[:, None], rows.weights, 0.0)
        return rows, pending.handle

    # ----- combine -----------------------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: TwoPhaseHandle) -> torch.Tensor:
        t0 = self.stats.now()
        H, me, here, layer, C = self.hidden_size, self.rank, self.my_node, handle.layer, self.capacity
        width = H * self.dtype.itemsize
        self._wait(handle.sends)
        pending = self._combine_sends

        def as_bytes(x: torch.Tensor) -> torch.Tensor:
            return x.to(self.dtype).contiguous().view(torch.uint8).view(-1, width)

        def as_hidden(x: torch.Tensor) -> torch.Tensor:
            return x.contiguous().view(self.dtype).view(-1, H)

        # Step 3 back: each expert rank returns every row place to the nd gateway it came from
        out_rows, sends, start = as_bytes(expert_out), [], 0
        for i, g in enumerate(self.nd_gateways):
            n = self._nd_bound(g, C)
            sends.append((g, self._tag(6, 0), self._reply(out_rows[start:start + n], handle.from_nd_gateways[i])))
            start += n
        experts = self.node_experts if handle.fan_hit is not None else []
        n = self._nd_bound(me, C) if experts else 0
        got = self._exchange(sends, [(r, self._tag(6, 0), n) for r in experts], width, layer, "combine", pending)
        # Step 2 back: add up each row over this node's expert ranks, return each ns gateway its rows
        sends = []
        if experts:
            back = torch.stack([as_hidden(g[1:]) for g in got])                              # [M_n, R, H]
            acc, start = as_bytes(gather_rows(back, handle.fan_hit, handle.fan_pos)), 0
            for i, ns in enumerate(self.gateway_of):
                n = self._bound(ns, C)
                sends.append((self.gateways(ns, here)[0], self._tag(5, ns),
                              self._reply(acc[start:start + n], handle.from_gateways[i])))
                start += n
        got = self._exchange(sends, [(self.gateways(here, nd)[1], self._tag(5, here), self._bound(here, C))
                                     for nd in self.gateway_for], width, layer, "combine", pending)
        # Step 1 back: hand each source its row places
        sends = []
        for nd, block in zip(self.gateway_for, got):
            per_source = expand(block, handle.where[nd])                                     # [S_n, C, width]
            sends += [(s, self._tag(4, nd), self._reply(per_source[i], handle.from_sources[nd][i]))
                      for i, s in enumerate(self.node_sources)]
        back = self.dst_nodes if self.is_source else []
        got = self._exchange(sends, [(self.gateways(here, nd)[0], self._tag(4, nd), C) for nd in back], width, layer,
                             "combine", pending)
        if self.is_source:
            out = gather_rows(torch.stack([as_hidden(g[1:]) for g in got]).view(len(back), C, H), handle.hit,
                              handle.pos)
        else:
            out = torch.zeros(handle.num_tokens, H, dtype=self.dtype, device=self.device)
        self.stats.phase(layer, "combine").add(0, 0, self.stats.now() - t0)
        return out


class AutoDispatcher(Dispatcher):
    """Per call, `direct` or `two_phase`, whichever the cost model predicts faster for the step's capacity and
    this topology (every rank holds the same model and capacity, so every rank makes the same choice)."""

    def __init__(self, group, hidden_size, top_k, dtype, device, num_sources, stats=None, ranks_per_node=None,
                 nodes=None, *, model: CostModel):
        super().__init__(group, hidden_size, top_k, dtype, device, num_sources, stats, ranks_per_node, nodes)
        args = (group, hidden_size, top_k, dtype, device, num_sources, self.stats, ranks_per_node, nodes)
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

    def flush(self) -> None:
        for d in self.modes.values():
            d.flush()
