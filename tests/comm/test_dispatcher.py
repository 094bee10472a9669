"""The direct dispatcher on real gloo ranks: dedup per (token, destination), exact routing (payloads
encode the sender), weighted sums done on the expert side, zero-token ranks included. The collective transport
hands an expert rank fixed-shape rows (every source's capacity rows; places past a source's count hold zeros and
slot -1); the shm transport with in-band counts and two or more expert ranks hands it one place per token of each
source (not the capacity), the places no token takes there empty; otherwise the shm transport hands over exactly the
routed rows."""
from __future__ import annotations

import pytest
import torch

from comm.dispatcher import plan_rows
from tests.dist_utils import run_ranks

H, K, S = 8, 3, 4


def _routing(rank, A, E, T, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    hidden = torch.randn(T, H, generator=g)
    hidden[:, 0] = rank          # sender rank
    hidden[:, 1] = torch.arange(T)  # token index
    phy = torch.stack([torch.randperm(E * S, generator=g)[:K] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    weights = torch.rand(T, K, generator=g)
    return hidden, A + phy // S, phy % S, weights


def _rank_fn(rank, world, A, tokens_per_rank, seed, transport="collective"):
    import torch.distributed as dist

    from comm.dispatcher import DirectDispatcher
    from comm.shm_dispatcher import ShmDispatcher
    dist.init_process_group("gloo", rank=rank, world_size=world)
    E = world - A
    kw = dict(group=dist.group.WORLD, hidden_size=H, top_k=K, dtype=torch.float32, device=torch.device("cpu"),
              num_sources=A)
    if transport.startswith("shm"):
        d = ShmDispatcher(**kw, control=dist.group.WORLD, max_tokens=16, timeout_s=30,
                          in_band=transport == "shm_in_band")
        assert d.in_band == (transport == "shm_in_band" and world - A > 1)
    else:
        d = DirectDispatcher(**kw)
    d.set_capacity(max(tokens_per_rank))
    if rank < A:
        hidden, dst, slots, weights = _routing(rank, A, E, tokens_per_rank[rank], seed)
    else:
        hidden, dst, slots, weights = d.empty_tokens()
    rows, handle = d.dispatch(0, hidden, dst, slots, weights)
    # Expert side "FFN": slot s scales by (s + 1 + 10 * rank); weighted sum over local choices.
    scale = (rows.slots + 1 + 10 * rank).float() * (rows.slots >= 0)
    expert_out = rows.hidden * (rows.weights * scale).sum(1, keepdim=True)
    out = d.combine(expert_out, handle)
    return {"out": out, "rows": rows, "stats": d.stats.to_dict(), "inputs": (hidden, dst, slots, weights)}


@pytest.mark.parametrize("transport", ["collective", "shm", "shm_in_band"])
@pytest.mark.parametrize("A,E,tokens", [(2, 2, [5, 7]), (1, 3, [9]), (2, 3, [0, 6]), (3, 1, [4, 0, 2])])
def test_direct_dispatch_combine(A, E, tokens, transport):
    # places: an expert rank gets every source's capacity rows (collective) or a place per token (in-band shm)
    places = {"collective": [max(tokens)] * A, "shm_in_band": tokens if E > 1 else None}.get(transport)
    res = run_ranks(_rank_fn, A + E, A, tokens, 1, transport)
    for r in range(A):
        hidden, dst, slots, weights = res[r]["inputs"]
        scale = (slots + 1 + 10 * dst).float()
        expected = hidden * (weights * scale).sum(1, keepdim=True)
        torch.testing.assert_close(res[r]["out"], expected, atol=1e-5, rtol=1e-5)
        assert res[r]["rows"].hidden.shape[0] == 0
    for e in range(A, A + E):
        rows = res[e]["rows"]
        valid = (rows.slots >= 0).any(1)
        if places is not None:
            assert rows.hidden.shape[0] == sum(places)
            assert not rows.hidden[~valid].any() and not rows.weights[~valid].any()
        rows.hidden, rows.slots = rows.hidden[valid], rows.slots[valid]
        want = 0
        for r in range(A):
            hidden, dst, slots, _ = res[r]["inputs"]
            hit = (dst == e).any(1)
            want += int(hit.sum())
            mine = rows.hidden[rows.hidden[:, 0] == r]
            # exactly the tokens of rank r that chose rank e, once each, in token order
            assert mine[:, 1].long().tolist() == torch.nonzero(hit).flatten().tolist()
            torch.testing.assert_close(mine, hidden[hit])
        assert rows.hidden.shape[0] == want
        assert ((rows.slots >= 0).sum(1) >= 1).all()
    # collective: each source sends every expert rank one block of capacity + 1 rows, whatever it routes
    # there; in-band shm: its tokens' places; shm: exactly the routed rows. Either way one message per expert rank.
    row_bytes = 4 * H + 8 * K
    for r in range(A):
        st = res[r]["stats"]["0"]["dispatch"]
        routed = sum(int((res[r]["inputs"][1] == e).any(1).sum()) for e in range(A, A + E))
        want = routed * row_bytes if places is None else \
            E * (places[r] + (transport == "collective")) * row_bytes
        assert (st["bytes_sent"], st["messages_sent"]) == (want, E)
    for e in range(A, A + E):
        assert res[e]["stats"]["0"]["dispatch"]["messages_sent"] == 0


def test_plan_rows_dedups_per_destination():
    dst = torch.tensor([[5, 5, 6], [6, 6, 6]])
    slots = torch.tensor([[0, 1, 2], [3, 0, 1]])
    w = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]])
    row2token, row_dst, row_slots, row_w = plan_rows(dst, slots, w, 8)
    assert row2token.tolist() == [0, 0, 1] and row_dst.tolist() == [5, 6, 6]
    assert row_slots.tolist() == [[0, 1, -1], [-1, -1, 2], [3, 0, 1]]
    assert row_w[0].tolist() == [0.5, 0.25, 0.0]


def counts_of_call(rank: int, call: int, num_experts: int) -> torch.Tensor:
    """What attention rank `rank` gathers in call `call`: its rank and the call are in every value."""
    return torch.arange(num_experts) + 100 * rank + 10000 * call


def _gather_counts_rank(rank, world, A, depth, num_experts, calls):
    import torch.distributed as dist

    from comm import p2p
    from comm.shm_dispatcher import ShmDispatcher

    def collective(*args, **kwargs):
        raise AssertionError("the collective gather ran")
    p2p.all_gather_into = collective
    dist.init_process_group("gloo", rank=rank, world_size=world)
    d = ShmDispatcher(group=dist.group.WORLD, hidden_size=H, top_k=K, dtype=torch.float32,
                      device=torch.device("cpu"), num_sources=A, control=dist.group.WORLD, max_tokens=16,
                      depth=depth, timeout_s=30, count_words=num_experts)
    d.set_capacity(4)
    seen = []
    for call in range(calls):   # as the engine runs a layer: the counts, then the dispatch and combine
        if rank < A:
            out = torch.full((A * num_experts,), -1, dtype=torch.int64)
            d.gather_counts(out, counts_of_call(rank, call, num_experts), None)
            seen.append(out.tolist())
            hidden, dst, slots, weights = _routing(rank, A, world - A, 3, call)
        else:
            hidden, dst, slots, weights = d.empty_tokens()
        rows, handle = d.dispatch(call, hidden, dst, slots, weights)
        d.combine(rows.hidden, handle)
    return d.count_inbox is not None, seen


@pytest.mark.parametrize("A,E,depth", [(2, 2, 2), (3, 1, 3)])
def test_the_same_host_transport_gathers_the_attention_ranks_counts_through_its_inboxes(A, E, depth):
    """With count_words, every attention rank gets every attention rank's counts, in rank order, call after call
    (past the slots' depth), interleaved with dispatches as in the engine, and no collective runs; expert ranks
    own no counts inbox."""
    num_experts, calls = 6, 2 * depth + 1
    results = run_ranks(_gather_counts_rank, A + E, A, depth, num_experts, calls)
    for rank, (has_inbox, seen) in enumerate(results):
        assert has_inbox == (rank < A)
        want = [torch.cat([counts_of_call(a, c, num_experts) for a in range(A)]).tolist() for c in range(calls)]
        assert seen == (want if rank < A else [])


def test_counts_go_by_inbox_where_the_collective_would_wait_on_the_host():
    from comm.shm_dispatcher import counts_by_inbox
    assert counts_by_inbox(2, "gloo", False)        # CPU ranks, or GPU ranks sharing GPUs: gloo through host memory
    assert not counts_by_inbox(2, "nccl", False)    # a GPU each: NCCL, no host wait
    assert counts_by_inbox(2, "nccl", True)         # events: no host wait either way
    assert not counts_by_inbox(1, "gloo", False)    # one attention rank gathers nothing
