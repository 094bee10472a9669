"""MoEContext.start: least_loaded plans from every attention rank's per-expert counts, gathered in rank order
into one buffer that later calls reuse; on one rank it reads nothing on the host; the replicas it dispatches to are
the policy's choice, mapped to (world rank, slot)."""
from __future__ import annotations

import torch

from attention_nodes.model import MoEContext
from balancer.placement import eplb, slot_capacities
from balancer.policy import LeastLoadedPolicy
from comm.dispatcher import Dispatcher, Layout
from tests.dist_utils import run_ranks
from tests.host_reads import no_host_reads

E, K, N_EXPERT_RANKS = 8, 2, 3


class RecordingPolicy(LeastLoadedPolicy):
    """least_loaded, keeping a copy of the counts each choose() got."""

    def choose(self, layer, topk_ids, counts=None, source=0):
        self.seen.append(counts.clone())
        return super().choose(layer, topk_ids, counts, source)


class RecordingDispatcher(Dispatcher):
    """Records what start_dispatch is asked to send; gathers counts as the collective transports do."""

    def __init__(self, world: int, rank: int):
        super().__init__(Layout(world, rank), 4, K, torch.float32, torch.device("cpu"), world - N_EXPERT_RANKS)
        self.sent = []

    def start_dispatch(self, layer, hidden, dst_ranks, slots, weights):
        self.sent.append((dst_ranks, slots))

    def finish_dispatch(self, pending):
        raise NotImplementedError

    def combine(self, expert_out, handle):
        raise NotImplementedError


def make_context(num_attention_ranks: int, source: int, group=None) -> MoEContext:
    placement = eplb(torch.arange(1, E + 1).double()[None].repeat(2, 1), slot_capacities(E, 4, N_EXPERT_RANKS))
    policy = RecordingPolicy(placement, fixed_shape=True)     # the plan a GPU runs, which must read nothing
    policy.seen = []
    dispatcher = RecordingDispatcher(num_attention_ranks + N_EXPERT_RANKS, source)
    return MoEContext(dispatcher, policy, num_attention_ranks, placement.num_slots, E, group, source)


def routed(rank: int, tokens: int) -> torch.Tensor:
    """`[tokens, K]` distinct experts; rank r routes every token to expert r, so the counts show the sender."""
    g = torch.Generator().manual_seed(rank)
    other = (rank + 1 + torch.randint(0, E - 1, (tokens, 1), generator=g)) % E
    return torch.cat([torch.full((tokens, 1), rank), other], dim=1)


def test_one_rank_counts_its_own_pairs_without_a_host_read():
    ctx = make_context(1, 0)
    ids = routed(0, 5)
    with no_host_reads():
        ctx.start(1, torch.zeros(5, 4), ids, torch.ones(5, K))
    assert ctx.policy.seen[0].tolist() == [torch.bincount(ids.flatten(), minlength=E).tolist()]
    dst, slots = ctx.dispatcher.sent[0]
    phy = (dst - 1) * ctx.num_slots + slots                   # world rank 1.. are the expert ranks
    assert torch.equal(ctx.policy.placement.slot2expert[1].flatten()[phy], ids)


def _gather_on_rank(rank, world):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from comm import p2p
    asked, wire = [], p2p.wire
    p2p.wire = lambda tensor, group: asked.append(group) or wire(tensor, group)
    ctx = make_context(world, rank, dist.group.WORLD)
    buffers = []
    for layer, tokens in enumerate([3 + rank, 2 * rank]):   # rank 0 routes nothing in the second call
        ctx.start(layer, torch.zeros(tokens, 4), routed(rank, tokens), torch.ones(tokens, K))
        buffers.append(ctx.counts.data_ptr())
    return [c.tolist() for c in ctx.policy.seen], buffers[0] == buffers[1], len(asked)


def test_counts_are_every_attention_ranks_in_rank_order():
    world = 3
    results = run_ranks(_gather_on_rank, world)
    want = [[torch.bincount(routed(r, tokens).flatten(), minlength=E).tolist() for r, tokens in enumerate(sizes)]
            for sizes in ([3, 4, 5], [0, 2, 4])]
    for seen, reused, asked in results:
        assert seen == want and reused
        assert asked == 1      # where the gather travels is decided once, not per layer
